#!/usr/bin/env bash
# torchrun_commands.sh: print the torchrun command to run on each node, for clusters
# without Slurm (cloud machines, a few workstations). Nothing is started.
#
# Usage: torchrun_commands.sh NODES PROCS_PER_NODE HEAD_ADDRESS [mnist_ddp.py options]
#   NODES           number of machines
#   PROCS_PER_NODE  training processes per machine: its GPUs, or CPU workers
#   HEAD_ADDRESS    an address of the first machine that every machine can reach
# Variables [defaults]:
#   PORT            rendezvous port on the head machine  [29400]
#   RUN_ID          rendezvous id; new for every run     [mnist-<date and time>]
#   SCRIPT          the training script as the nodes see it  [mnist_ddp.py]
#
# Example: torchrun_commands.sh 2 4 10.0.0.5 --dataset mnist --epochs 8
set -euo pipefail

die() { echo "torchrun_commands.sh: $*" >&2; exit 2; }
if [[ $# -lt 3 ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2
    exit 2
fi
nodes=$1 procs=$2 head=$3
shift 3
[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, got '$nodes'"
[[ $procs =~ ^[1-9][0-9]*$ ]] || die "PROCS_PER_NODE must be a positive number, got '$procs'"
[[ -n $head && $head != -* ]] || die "HEAD_ADDRESS must be an address of the first machine, got '$head'"
port=${PORT:-29400}
run_id=${RUN_ID:-mnist-$(date +%Y%m%d-%H%M%S)}
script=${SCRIPT:-mnist_ddp.py}
options=""
if [[ $# -gt 0 ]]; then options=" $(printf '%q ' "$@")"; options=${options% }; fi

echo "# Run one line on each machine (same directory layout and environment on all)."
echo "# The data directory must be shared, or staged on every machine beforehand."
for ((node = 0; node < nodes; node++)); do
    echo "# machine $node$([[ $node == 0 ]] && echo " ($head)")"
    echo "OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1} torchrun --nnodes=$nodes --nproc-per-node=$procs" \
         "--rdzv-backend=c10d --rdzv-endpoint=$head:$port --rdzv-id=$run_id --node-rank=$node $script$options"
done
