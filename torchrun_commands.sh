#!/usr/bin/env bash
# torchrun_commands.sh: print the torchrun command to run on each node, for clusters
# without Slurm (cloud machines, a few workstations). Nothing is started.
#
# Usage: torchrun_commands.sh NODES PROCS_PER_NODE HEAD_ADDRESS [mnist_ddp.py options]
#   NODES           number of machines, 1-10000
#   PROCS_PER_NODE  training processes per machine, 1-1024: its GPUs, or CPU workers
#   HEAD_ADDRESS    a host name, IPv4 or IPv6 address of the first machine that every
#                   machine can reach
# Variables [defaults]:
#   PORT            rendezvous port on the head machine, 1024-65535  [29400]
#   RUN_ID          rendezvous id, letters, digits and ._-; new for every run
#                                                        [mnist-<date and time>]
#   SCRIPT          the training script as the nodes see it  [mnist_ddp.py]
#
# Example: torchrun_commands.sh 2 4 10.0.0.5 --dataset mnist --epochs 8
set -euo pipefail

die() { echo "torchrun_commands.sh: $*" >&2; exit 2; }
# decimal VAR MIN MAX WHAT: VAR's value as a decimal number from MIN to MAX, written back
# without leading zeros, else one line and exit 2. Bash's arithmetic reads 010 as octal.
decimal() {
    local value=${!1} min=$2 max=$3
    if [[ ! $value =~ ^0*([0-9]{1,9})$ ]] || (( 10#${BASH_REMATCH[1]} < min || 10#${BASH_REMATCH[1]} > max )); then
        die "$4 must be a number from $min to $max, got '$value'"
    fi
    printf -v "$1" %d "$((10#${BASH_REMATCH[1]}))"
}
if [[ $# -lt 3 ]]; then
    sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2
    exit 2
fi
nodes=$1 procs=$2 head=$3
shift 3
port=${PORT:-29400}
run_id=${RUN_ID:-mnist-$(date +%Y%m%d-%H%M%S)}
script=${SCRIPT:-mnist_ddp.py}
decimal nodes 1 10000 NODES
decimal procs 1 1024 PROCS_PER_NODE
decimal port 1024 65535 PORT
if [[ $head =~ ^[[:alnum:]]([[:alnum:].-]*[[:alnum:]])?$ ]]; then
    endpoint=$head:$port
elif [[ $head =~ ^\[?([0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)\]?$ ]]; then
    endpoint=[${BASH_REMATCH[1]}]:$port  # torchrun reads an IPv6 address in brackets
else
    die "HEAD_ADDRESS must be a host name or an address of the first machine, got '$head'"
fi
[[ $run_id =~ ^[[:alnum:]_.-]+$ ]] || die "RUN_ID must be letters, digits and ._-, got '$run_id'"
[[ $script != -* ]] || die "SCRIPT must be a path, got '$script'; write ./$script"

echo "# Run one line on each machine (same directory layout and environment on all)."
echo "# The data directory must be shared, or staged on every machine beforehand."
for ((node = 0; node < nodes; node++)); do
    echo "# machine $node$([[ $node == 0 ]] && echo " ($head)")"
    # Quoted for a shell to read back word for word: a SCRIPT path or option with spaces stays one word.
    printf -v line '%q ' torchrun --nnodes="$nodes" --nproc-per-node="$procs" --rdzv-backend=c10d \
        --rdzv-endpoint="$endpoint" --rdzv-id="$run_id" --node-rank="$node" "$script" "$@"
    echo "OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1} ${line% }"
done
