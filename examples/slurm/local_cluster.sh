#!/usr/bin/env bash
# A two-node SLURM cluster on this one machine, for CI and for trying the SLURM scripts:
# munged, slurmctld and two slurmd ("node1", "node2": Debian's slurmd is built with
# --enable-multiple-slurmd, so `slurmd -N NAME` runs one per node name, each on its own
# port), CPU-only nodes, no cgroups (containers rarely have them), no accounting database.
#
#   examples/slurm/local_cluster.sh start    # install if missing (root), start, wait idle
#   examples/slurm/local_cluster.sh status   # exit 0 iff both nodes answer
#   examples/slurm/local_cluster.sh stop     # cancel jobs, stop every daemon it started
#
# Everything lives in LOCAL_CLUSTER_DIR (/tmp/megaulysses-slurm): slurm.conf, state, logs,
# munge's key and socket, pid files. Clients find the configuration through SLURM_CONF
# (`eval "$(examples/slurm/local_cluster.sh env)"`); where /etc/slurm/slurm.conf does not
# exist, start links it there so that a bare `sbatch` works too, and stop removes the link.
# The node names resolve through /etc/hosts lines this script adds (and stop removes):
# torchrun's rendezvous endpoint is the allocation's first node name.
#
# Node sizes are declared, not measured (SlurmdParameters=config_overrides): 64 CPUs a
# node, so pretrain_gpt.sbatch's `--cpus-per-task=64 --exclusive` is accepted unchanged;
# no process is bound to a CPU (task/none), so the declaration costs nothing.
# No slurmdbd (it needs MariaDB): sacct has no data; job states come from
# `scontrol show job` (kept MinJobAge seconds after the end) and the jobcomp file
# $LOCAL_CLUSTER_DIR/jobcomp.txt (one line per finished job, JobState=...).
set -euo pipefail

DIR=${LOCAL_CLUSTER_DIR:-/tmp/megaulysses-slurm}
PORT=${LOCAL_CLUSTER_PORT:-6917}  # slurmctld; the slurmds take the next two
CPUS=${LOCAL_CLUSTER_CPUS:-64}
NODES=(node1 node2)
CONF=$DIR/etc/slurm.conf
HOSTS_TAG="# megaulysses local_cluster.sh"
export SLURM_CONF=$CONF

log() { echo "local_cluster.sh: $*" >&2; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null &&
        command -v sbatch >/dev/null && command -v munged >/dev/null && return 0
    [[ $(id -u) == 0 ]] || { log "slurmctld/slurmd/munge missing and not root: install" \
        "slurmctld slurmd slurm-client munge"; exit 1; }
    local pkgs=(slurmctld slurmd slurm-client munge)
    # --no-install-recommends: the daemons and clients only (slurm-wlm pulls ~20 plugins)
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}" \
        >"$DIR/apt.log" 2>&1 || { apt-get update -q >>"$DIR/apt.log" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        "${pkgs[@]}" >>"$DIR/apt.log" 2>&1; } || { log "apt-get failed: $DIR/apt.log"; exit 1; }
}

write_conf() {
    mkdir -p "$DIR"/{etc,state,log,run,munge} "$DIR"/spool/{node1,node2}
    local mem=2048  # MB a node, declared: the jobs ask for none
    cat >"$CONF" <<EOF
# Written by examples/slurm/local_cluster.sh: two slurmd on this host.
ClusterName=megaulysses
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also delays a requeued job's restart (default 120 s)
AuthInfo=socket=$DIR/munge/munge.socket,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
# Pending jobs (a requeued one, once eligible) are looked at every 2 s, not every 60; a
# submitted batch job is scheduled at once (batch_sched_delay=0): the default lets it wait
# up to 3 s for others to schedule together (~1 s from sbatch to start on average here,
# ~0.5 s without; tests/slurm submits a dozen jobs)
SchedulerParameters=sched_interval=2,batch_sched_delay=0
MpiDefault=none
MailProg=/bin/true
SwitchType=switch/none
LaunchParameters=use_interactive_step
SlurmdParameters=config_overrides
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.txt
ReturnToService=2
# Only jobs submitted with --requeue are requeued (a node failure otherwise requeues every
# batch job): what pretrain_gpt.sbatch's comment tells users to pass.
JobRequeue=0
# A lost node is noticed within ~30 s: the job's other node must first see its collective
# fail and name the lost ranks (the roll call ends 11 s after the failure at the tests'
# --distributed-timeout-minutes 0.1; more on a loaded 2-core machine); a killed job's
# processes get 30 s to save.
SlurmdTimeout=30
SlurmctldTimeout=10
KillWait=30
MinJobAge=3600
InactiveLimit=0
Waittime=0
NodeName=node1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=$mem State=UNKNOWN
NodeName=node2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP
EOF
}

# The pid file's process runs (the daemon may remove its file at any moment).
alive() { local pid; pid=$(cat "$1" 2>/dev/null) && kill -0 "$pid" 2>/dev/null; }

start_munge() {
    alive "$DIR/run/munged.pid" && return 0
    if [[ ! -f $DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 700 "$DIR/munge"
    chmod 400 "$DIR/munge/munge.key"
    # root runs it: --force (munged prefers its own user, which a state dir under /tmp
    # owned by root would not suit)
    munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed"
}

add_hosts() {
    local name addr
    for name in "${NODES[@]}"; do
        addr=$(getent hosts "$name" | awk '{print $1; exit}') || true
        [[ -z $addr || $addr == 127.0.0.1 ]] ||
            { log "$name resolves to $addr, not this machine: stop"; exit 1; }
    done
    grep -q "$HOSTS_TAG" /etc/hosts && return 0
    # /etc/hosts may be a bind mount (containers): rewrite in place, no rename
    echo "127.0.0.1 ${NODES[*]} $HOSTS_TAG" >>/etc/hosts
}

remove_hosts() {
    grep -q "$HOSTS_TAG" /etc/hosts 2>/dev/null || return 0
    local kept
    kept=$(grep -v "$HOSTS_TAG" /etc/hosts)
    printf '%s\n' "$kept" >/etc/hosts
}

link_conf() {
    if [[ ! -e /etc/slurm/slurm.conf && -d /etc/slurm ]]; then
        ln -s "$CONF" /etc/slurm/slurm.conf
    fi
}

unlink_conf() {
    if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
        rm -f /etc/slurm/slurm.conf
    fi
}

# Both nodes idle (or busy with jobs): the cluster answers.
nodes_up() {
    local states
    states=$(timeout 10 sinfo -h -N -o '%N %T' 2>/dev/null) || return 1
    [[ $(grep -cE '^node[12] (idle|allocated|mixed|completing)$' <<<"$states") == 2 ]]
}

start() {
    mkdir -p "$DIR"
    install_packages
    alive "$DIR/run/slurmctld.pid" || write_conf  # a running cluster keeps its own
    start_munge
    add_hosts
    link_conf
    alive "$DIR/run/slurmctld.pid" || slurmctld -f "$CONF"
    local node
    for node in "${NODES[@]}"; do
        alive "$DIR/run/slurmd-$node.pid" || slurmd -f "$CONF" -N "$node"
    done
    local i
    for i in $(seq 100); do  # ~1-2 s normally; a node that was DOWN returns on registering
        nodes_up && { log "up: $(sinfo -h -N -o '%N %T' | tr '\n' ' ')(SLURM_CONF=$CONF)"; return 0; }
        sleep 0.3
    done
    log "nodes did not come up in 30 s:"; sinfo -N >&2 || true
    tail -5 "$DIR"/log/*.log >&2 || true
    exit 1
}

# Wait until each pid file's process is gone (up to ~20 s), then SIGKILL what is left.
wait_gone() {
    local f i
    for f in "$@"; do
        for i in $(seq 100); do alive "$f" || break; sleep 0.2; done
        if alive "$f"; then log "$(basename "$f") did not stop: SIGKILL"; kill -9 "$(cat "$f")" || true; fi
        rm -f "$f"
    done
}

stop() {
    local pids=("$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid")
    if alive "$DIR/run/slurmctld.pid"; then
        # Jobs first: their processes (slurmstepd and below) outlive the daemons otherwise.
        local jobs; jobs=$(squeue -h -o %i 2>/dev/null) || true
        [[ -z $jobs ]] || scancel --full --quiet $jobs 2>/dev/null || true
        local i
        for i in $(seq 150); do
            [[ -z $(squeue -h -o %i 2>/dev/null) ]] && break
            sleep 0.2
        done
        scontrol shutdown 2>/dev/null || true
    fi
    for f in "${pids[@]}"; do
        if alive "$f"; then kill -TERM "$(cat "$f")" 2>/dev/null || true; fi
    done
    wait_gone "${pids[@]}"
    if alive "$DIR/run/munged.pid"; then kill -TERM "$(cat "$DIR/run/munged.pid")" || true; fi
    wait_gone "$DIR/run/munged.pid"
    unlink_conf
    remove_hosts
    log "stopped"
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) nodes_up ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
