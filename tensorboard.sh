#!/usr/bin/env bash
#SBATCH --job-name=tensorboard          # as a job: sbatch tensorboard.sh [--logdir DIR]
#SBATCH --ntasks=1                      # one process, one CPU: TensorBoard only reads files
#SBATCH --cpus-per-task=1
#SBATCH --mem=2G
#SBATCH --time=04:00:00                 # scancel JOBID stops it sooner
#SBATCH --output=tensorboard-%j.out     # the tunnel command and URL are at its top
#
# Usage: tensorboard.sh [--logdir DIR] [--port N] [--bind-all] [-- extra tensorboard options]
#   --logdir DIR   directory holding the run directories     [LOG_DIR, else ./runs]
#   --port N       port to try first, 1024-65535; if taken, the next free one is used
#                  [PORT, else 6006; in a Slurm job, random]
#                  random: a random port from 20000-29999, harder for others on the node to guess
#   --bind-all     listen on every interface: anyone who can reach this node sees your runs
#   -h, --help     this text
# Variables:
#   LOG_DIR        as --logdir
#   PORT           as --port
#   PYTHON         interpreter whose TensorBoard to run (a run's view line names its own
#                  when this file would not find it); one without TensorBoard (a path in a
#                  container) gives way to the next two  [tensorboard on the PATH, else VENV's]
#   VENV           virtual environment to activate, when tensorboard is not on the PATH
#                  [./.venv, else the .venv beside this file, found from any directory]
#   LOGIN_HOST     login node for the tunnel command on compute nodes  [SLURM_SUBMIT_HOST]
#
# TensorBoard on the runs of mnist_ddp.py, reloading every second, bound to
# 127.0.0.1, which you reach through an SSH tunnel. That keeps it off the network, not
# private: TensorBoard has no password, and anyone logged in to the same machine can open
# 127.0.0.1:PORT too. On a shared login node, prefer running it on a compute node inside a
# job, or at least --port random. Runs in the foreground; Ctrl-C stops it.
#
# As a Slurm job (the #SBATCH lines above do nothing when you run it directly):
#   sbatch tensorboard.sh [--logdir DIR]     then: head tensorboard-<jobid>.out
# runs it on a compute node on a free random port and writes the two-hop ssh tunnel
# (through the login node you submitted from, or LOGIN_HOST) and the URL at the top of
# its output file. scancel or the time limit stop it.
#
# It prints the ssh command to run on your own computer, then the URL to open there.
set -euo pipefail

die() { echo "tensorboard.sh: $*" >&2; exit 2; }
quoted() { local line; printf -v line '%q ' "$@"; echo "${line% }"; }  # a command line to paste
usage() { sed -n '/^# Usage:/,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }  # (not the #SBATCH lines)

logdir=${LOG_DIR:-runs}
port=${PORT:-6006}
if [[ -n ${SLURM_JOB_ID:-} && -z ${PORT:-} ]]; then port=random; fi  # in a job: not a port others guess
# Where this file lives, also as a batch job: Slurm runs a copy, scontrol names the original.
here=$(cd "$(dirname "$0")" && pwd)
if [[ -n ${SLURM_JOB_ID:-} && ! -f $here/mnist_ddp.py ]]; then
    original=$(scontrol show job -o "$SLURM_JOB_ID" 2>/dev/null | sed -n '1s/.* Command=\([^ ]*\).*/\1/p' || true)
    if [[ -n $original ]]; then here=$(dirname "$original"); fi
fi
host=127.0.0.1
extra=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --logdir) [[ $# -ge 2 ]] || die "--logdir needs a directory"; logdir=$2; shift 2 ;;
        --logdir=*) logdir=${1#*=}; shift ;;
        --port) [[ $# -ge 2 ]] || die "--port needs a number"; port=$2; shift 2 ;;
        --port=*) port=${1#*=}; shift ;;
        --bind-all) host=0.0.0.0; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; extra=("$@"); break ;;
        *) die "unknown option '$1'; see tensorboard.sh --help" ;;
    esac
done
if [[ $port == random ]]; then port=$((20000 + RANDOM % 10000)); fi  # then the next free one, below
# As a decimal number: bash's arithmetic reads 00080 as octal, and 08 not at all.
if [[ ! $port =~ ^0*([0-9]{1,5})$ ]] || (( 10#${BASH_REMATCH[1]} < 1024 || 10#${BASH_REMATCH[1]} > 65535 )); then
    die "--port must be a number from 1024 to 65535 or 'random', got '$port'"
fi
port=$((10#${BASH_REMATCH[1]}))
[[ -d $logdir ]] || die "log directory '$logdir' does not exist; train first (python mnist_ddp.py) or pass --logdir DIR"

tensorboard=(tensorboard)
python=python3
venv=${VENV:-.venv}
if [[ -z ${VENV:-} && ! -f $venv/bin/activate ]]; then venv=$here/.venv; fi
if [[ -n ${PYTHON:-} ]] && "$PYTHON" -c 'import tensorboard' >/dev/null 2>&1; then
    tensorboard=("$PYTHON" -m tensorboard.main)
    python=$PYTHON
elif ! command -v tensorboard >/dev/null 2>&1; then
    # A PYTHON without TensorBoard (a run's interpreter inside a container, say) falls back to these.
    [[ -z ${PYTHON:-} || -f $venv/bin/activate ]] \
        || die "PYTHON=$PYTHON cannot run TensorBoard; run: $(quoted "$PYTHON") -m pip install -r requirements.txt"
    [[ -f $venv/bin/activate ]] || die "tensorboard is not installed here: activate the virtual environment" \
        "(source .venv/bin/activate, or set VENV=path) or run: pip install -r requirements.txt"
    # shellcheck disable=SC1091  # the user's environment
    source "$venv/bin/activate"
    command -v tensorboard >/dev/null 2>&1 || die "$venv has no tensorboard; run: $(quoted "$venv/bin/pip") install -r requirements.txt"
fi

port_is_free() {  # bind where TensorBoard will bind; a listener on any address blocks it
    "$python" -c 'import socket, sys
s = socket.socket()
try:
    s.bind((sys.argv[1], int(sys.argv[2])))
except OSError:
    sys.exit(1)' "$host" "$1"
}
first=$port
until port_is_free "$port"; do
    (( port < first + 100 && port < 65535 )) || die "ports $first-$port are all taken; pass --port N"
    port=$((port + 1))
done
if (( port != first )); then echo "tensorboard.sh: port $first is taken; using $port"; fi

user=${USER:-$(id -un)}
node=$(hostname -f 2>/dev/null || hostname)
login=${LOGIN_HOST:-${SLURM_SUBMIT_HOST:-}}
echo "On your own computer, open the tunnel:"
if [[ -n $login && $login != "$(hostname -s)" && $login != "$node" ]]; then
    # On a compute node: TensorBoard listens on the node's loopback, so hop through the
    # login node to the compute node and forward to its localhost.
    echo "  $(quoted ssh -N -J "$user@$login" -L "$port:localhost:$port" "$user@$node")"
else
    echo "  $(quoted ssh -N -L "$port:localhost:$port" "$user@$node")"
    echo "  (from a compute node, go through the login node:" \
         "$(quoted ssh -N -J "$user@LOGIN_NODE" -L "$port:localhost:$port" "$user@$node"))"
fi
echo "then browse to http://localhost:$port/"
if [[ $host == 0.0.0.0 ]]; then
    echo "tensorboard.sh: warning: --bind-all: every user who can reach $node:$port sees these runs" >&2
fi
echo "TensorBoard on $host:$port, log directory $logdir (Ctrl-C to stop)"

exec "${tensorboard[@]}" --logdir "$logdir" --host "$host" --port "$port" --reload_interval 1 "${extra[@]}"
