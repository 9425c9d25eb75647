#!/usr/bin/env bash
# local-slurm.sh: a real Slurm cluster on this machine, to rehearse run_training.sbatch
# before the real cluster (and for the tests). Needs root.
#
# Usage:
#   local-slurm.sh install              install Debian's slurmctld slurmd slurm-client munge
#                                       (and, for the tests, shellcheck, openssh-server,
#                                       bubblewrap, iptables and dataset-fashion-mnist) where missing
#   local-slurm.sh start DIR [NODES]    start a cluster whose files all live under DIR:
#                                       NODES=1 (default): one node on the host's network;
#                                       NODES>1: NODES nodes, each slurmd in a network namespace
#                                       of its own, with its own hostname and address, on a
#                                       bridge in the controller's namespace (no route out)
#   local-slurm.sh exec DIR CMD...      run a client command (sbatch, squeue, ...) against it
#   local-slurm.sh stop DIR             cancel its jobs and stop exactly the daemons it started
#
# Then: export SLURM_CONF=DIR/slurm.conf (printed by start); with NODES>1 the clients must
# run in the controller's namespace, so use `local-slurm.sh exec DIR sbatch ...`.
#
# Variables (defaults in brackets):
#   LOCAL_SLURM_CPUS     CPUs each node advertises   [4 for one node, 1 per node for several;
#                        with task/affinity, this machine's CPUs]
#   LOCAL_SLURM_TASK_PLUGIN  task/none, or task/affinity to bind every task to the CPUs it
#                        was given, as real clusters do  [task/none]
#   LOCAL_SLURM_SELF_LOOPBACK  1: each node's own name resolves to 127.0.1.1 on that node,
#                        as Debian and Ubuntu installers write /etc/hosts  [0]
#   LOCAL_SLURM_CONF     more slurm.conf lines, e.g. to notice a dead node within seconds:
#                        $'SlurmdTimeout=6\nMessageTimeout=3'   [none]
#   LOCAL_SLURM_PORT     slurmctld port; slurmd uses the next one  [6817]
#   LOCAL_SLURM_SUBNET   first three octets of the namespaces' addresses  [10.231.7]
#   LOCAL_SLURM_PREFIX   prefix of node and namespace names  [ls]
#   LOCAL_SLURM_GPUS     fake GPUs each node advertises (Gres=gpu:N; no CUDA behind them),
#                        to see what a job that asks for GPUs is given  [0]
set -euo pipefail

die() { echo "local-slurm.sh: $*" >&2; exit 2; }
usage() { sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"; }

need_root() { [[ $(id -u) == 0 ]] || die "needs root (it starts daemons and network namespaces); run it with sudo"; }

install_packages() {
    local missing=()
    command -v slurmctld >/dev/null || missing+=(slurmctld)
    command -v slurmd >/dev/null || missing+=(slurmd)
    command -v sbatch >/dev/null || missing+=(slurm-client)
    command -v munged >/dev/null || missing+=(munge)
    command -v shellcheck >/dev/null || missing+=(shellcheck)
    command -v bwrap >/dev/null || missing+=(bubblewrap)  # the tests' container runtime (CONTAINER_CMD)
    command -v iptables >/dev/null || missing+=(iptables)  # the tests' firewall between two nodes (--check)
    [[ -x /usr/sbin/sshd ]] || missing+=(openssh-server)  # the tests' SSH tunnel to a compute node
    [[ -d /usr/share/datasets/fashion-mnist ]] || missing+=(dataset-fashion-mnist)
    (( ${#missing[@]} )) || return 0
    need_root
    echo "local-slurm.sh: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

wait_for() {  # wait_for SECONDS DESCRIPTION CMD...: poll CMD until it succeeds
    local seconds=$1 what=$2; shift 2
    local deadline=$((SECONDS + seconds))
    until "$@" >/dev/null 2>&1; do
        (( SECONDS < deadline )) || die "$what did not happen within ${seconds}s; see the logs under $DIR/log"
        sleep 0.2
    done
}

in_ctl() {  # run in the controller's network namespace when there is one
    if [[ -f $DIR/netns-ctl ]]; then nsenter --net="/run/netns/$(cat "$DIR/netns-ctl")" "$@"; else "$@"; fi
}

write_conf() {  # write_conf CTL_ADDR NODE_LINES...
    local ctl_addr=$1; shift
    local mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) * 9 / 10 / NODES ))
    cat > "$DIR/slurm.conf" <<EOF
ClusterName=local
SlurmctldHost=$(hostname -s)($ctl_addr)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_DIR/munge.socket,cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=$TASK_PLUGIN
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=sched_interval=1,bf_interval=1
MailProg=/bin/true
MpiDefault=none
ReturnToService=2
MinJobAge=4
KillWait=5
SlurmdParameters=config_overrides
EOF
    if [[ -n ${LOCAL_SLURM_CONF:-} ]]; then echo "$LOCAL_SLURM_CONF" >> "$DIR/slurm.conf"; fi
    local line gres="" gpus=${LOCAL_SLURM_GPUS:-0} i
    [[ $gpus =~ ^[0-9]$ ]] || die "LOCAL_SLURM_GPUS must be 0 to 9, got '$gpus'"
    if (( gpus > 0 )); then  # fake GPUs: character devices (/dev/null's) that Slurm hands out
        mkdir -p "$DIR/dev"
        for ((i = 0; i < gpus; i++)); do [[ -e $DIR/dev/gpu$i ]] || mknod "$DIR/dev/gpu$i" c 1 3; done
        echo "GresTypes=gpu" >> "$DIR/slurm.conf"
        echo "Name=gpu File=$DIR/dev/gpu[0-$((gpus - 1))]" > "$DIR/gres.conf"
        gres=" Gres=gpu:$gpus"
    fi
    for line in "$@"; do echo "$line$gres RealMemory=$mem CPUs=$CPUS State=UNKNOWN" >> "$DIR/slurm.conf"; done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$DIR/slurm.conf"
}

start_munge() {
    # munged wants every directory above its socket world-executable and none writable by
    # others, and socket paths are short: so a directory of its own under /tmp, not DIR.
    MUNGE_DIR=$(mktemp -d /tmp/local-munge.XXXXXX)
    chmod 755 "$MUNGE_DIR"
    echo "$MUNGE_DIR" > "$DIR/munge-dir"
    dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none
    chmod 400 "$MUNGE_DIR/munge.key"
    munged --socket="$MUNGE_DIR/munge.socket" --key-file="$MUNGE_DIR/munge.key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$MUNGE_DIR/seed"
    wait_for 10 "munged start" test -S "$MUNGE_DIR/munge.socket"
}

start_namespaces() {  # controller namespace with a bridge, one namespace per node
    local prefix=$1 ctl="$1-ctl" i node
    ip netns add "$ctl"
    echo "$ctl" > "$DIR/netns-ctl"
    ip -n "$ctl" link set lo up
    ip -n "$ctl" link add br0 type bridge
    ip -n "$ctl" addr add "$SUBNET.1/24" dev br0
    ip -n "$ctl" link set br0 up
    for i in $(seq 1 "$NODES"); do
        node="${prefix}n$i"
        # Every node name resolves to that node's address (on its own node too, unless
        # LOCAL_SLURM_SELF_LOOPBACK=1 makes it 127.0.1.1 there).
        { echo "127.0.0.1 localhost"; echo "$SUBNET.1 $(hostname -s)"
          local j
          for j in $(seq 1 "$NODES"); do
              if [[ $j == "$i" && ${LOCAL_SLURM_SELF_LOOPBACK:-0} == 1 ]]; then echo "127.0.1.1 ${prefix}n$j"
              else echo "$SUBNET.$((10 + j)) ${prefix}n$j"; fi
          done; } > "$DIR/hosts-$node"
        ip netns add "$node"
        echo "$node" >> "$DIR/netns-nodes"
        ip -n "$ctl" link add "v$i" type veth peer name eth0 netns "$node"
        ip -n "$ctl" link set "v$i" master br0 up
        ip -n "$node" link set lo up
        ip -n "$node" addr add "$SUBNET.$((10 + i))/24" dev eth0
        ip -n "$node" link set eth0 up
    done
}

start_cluster() {
    need_root
    for tool in munged slurmctld slurmd sbatch; do
        command -v "$tool" >/dev/null || die "$tool is missing; run: local-slurm.sh install"
    done
    [[ ! -e $DIR/slurm.conf ]] || die "$DIR already holds a cluster; stop it first or use another DIR"
    mkdir -p "$DIR"/{state,spool,run,log}
    DIR=$(cd "$DIR" && pwd)
    start_munge
    local prefix=${LOCAL_SLURM_PREFIX:-ls} i
    if (( NODES == 1 )); then
        write_conf 127.0.0.1 "NodeName=$(hostname -s) NodeAddr=127.0.0.1"
    else
        start_namespaces "$prefix"
        local lines=()
        for i in $(seq 1 "$NODES"); do lines+=("NodeName=${prefix}n$i NodeAddr=$SUBNET.$((10 + i))"); done
        write_conf "$SUBNET.1" "${lines[@]}"
    fi
    export SLURM_CONF=$DIR/slurm.conf
    in_ctl slurmctld -f "$SLURM_CONF" -c -i
    wait_for 20 "slurmctld start" in_ctl scontrol ping
    if (( NODES == 1 )); then
        slurmd -f "$SLURM_CONF" -N "$(hostname -s)"
    else
        for i in $(seq 1 "$NODES"); do
            # Own hostname (UTS) and own /etc/hosts (mount namespace), so that every node
            # name resolves to that node's address and Gloo binds the bridge, not loopback.
            # nsenter --net, not `ip netns exec`, which remounts /sys and breaks slurmd.
            # shellcheck disable=SC2016  # $1..$3 are the inner shell's arguments
            nsenter --net="/run/netns/${prefix}n$i" unshare --uts --mount --propagation private \
                sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' \
                sh "${prefix}n$i" "$DIR/hosts-${prefix}n$i" "$SLURM_CONF"
        done
    fi
    wait_for 30 "all nodes idle" all_idle
    echo "local-slurm.sh: $NODES node(s) up; export SLURM_CONF=$SLURM_CONF"
}

all_idle() { [[ $(in_ctl sinfo -h -t idle -o %D) == "$NODES" ]]; }

stop_daemon() {  # stop_daemon PIDFILE NAME: kill it only if that pid is still NAME
    local pid
    [[ -f $1 ]] || return 0
    pid=$(cat "$1")
    if [[ $(ps -o comm= -p "$pid" 2>/dev/null) == "$2"* ]]; then
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
    rm -f "$1"
}

stop_cluster() {
    [[ -f $DIR/slurm.conf ]] || die "no cluster under $DIR"
    export SLURM_CONF=$DIR/slurm.conf
    in_ctl scancel --quiet --full "--partition=local" 2>/dev/null || true
    local pidfile
    for pidfile in "$DIR"/run/slurmd-*.pid; do stop_daemon "$pidfile" slurmd; done
    stop_daemon "$DIR/run/slurmctld.pid" slurmctld
    stop_daemon "$DIR/run/munged.pid" munged
    local ns
    if [[ -f $DIR/netns-nodes ]]; then
        while read -r ns; do ip netns del "$ns" 2>/dev/null || true; done < "$DIR/netns-nodes"
    fi
    if [[ -f $DIR/netns-ctl ]]; then ip netns del "$(cat "$DIR/netns-ctl")" 2>/dev/null || true; fi
    if [[ -f $DIR/munge-dir ]]; then rm -rf "$(cat "$DIR/munge-dir")"; fi
    rm -f "$DIR/slurm.conf" "$DIR/netns-ctl" "$DIR/netns-nodes" "$DIR/munge-dir"
    echo "local-slurm.sh: stopped the cluster under $DIR"
}

command=${1:-}
case $command in
    install) install_packages ;;
    start|stop|exec)
        [[ $# -ge 2 ]] || die "usage: local-slurm.sh $command DIR ...; see local-slurm.sh --help"
        DIR=$2
        NODES=1
        if [[ $command == start ]]; then NODES=${3:-1}; fi
        [[ $NODES =~ ^[1-9][0-9]*$ ]] || die "NODES must be a positive number, got '$NODES'"
        TASK_PLUGIN=${LOCAL_SLURM_TASK_PLUGIN:-task/none}
        [[ $TASK_PLUGIN == task/none || $TASK_PLUGIN == task/affinity ]] \
            || die "LOCAL_SLURM_TASK_PLUGIN must be task/none or task/affinity, got '$TASK_PLUGIN'"
        if [[ $TASK_PLUGIN == task/affinity ]]; then CPUS=${LOCAL_SLURM_CPUS:-$(nproc)}  # binding needs real CPUs
        elif (( NODES == 1 )); then CPUS=${LOCAL_SLURM_CPUS:-4}; else CPUS=${LOCAL_SLURM_CPUS:-1}; fi
        PORT=${LOCAL_SLURM_PORT:-6817}
        SUBNET=${LOCAL_SLURM_SUBNET:-10.231.7}
        case $command in
            start) start_cluster ;;
            stop) stop_cluster ;;
            exec)
                [[ -f $DIR/slurm.conf ]] || die "no cluster under $DIR; start one first"
                export SLURM_CONF=$DIR/slurm.conf
                shift 2
                in_ctl "$@" ;;
        esac ;;
    -h|--help|help) usage ;;
    *) usage >&2; exit 2 ;;
esac
