#!/bin/bash
# A real one-node SLURM cluster on this machine, with ckptd's prolog and epilog wired in.
#
#   deploy/slurm/one-node-cluster.sh up      install (if needed), configure, start; wait idle
#   deploy/slurm/one-node-cluster.sh down    stop slurmd, slurmctld and munged
#   deploy/slurm/one-node-cluster.sh status  show the daemons and the node state
#
# For tests and demos on a single Debian machine (no systemd needed: the daemons are
# started by hand). Needs root. Installs Debian's slurmd, slurmctld, slurm-client and
# munge, writes /etc/slurm/slurm.conf for one node named `hostname -s`
# (proctrack/linuxproc, task/none, PrologFlags=Alloc) and a ckptd prolog configuration in
# $STATE_DIR. Environment:
#   STATE_DIR         where generated files live      (default /var/lib/ckptd-one-node)
#   CKPTD_ROOTS       checkpoint roots for the daemons (default /tmp)
#   CKPTD_POOL_SIZE   staging pool per daemon          (default 256M)
#   CKPTD_BIN         ckptd executable                 (default: next to this python's)

set -euo pipefail

REPO=$(cd "$(dirname "$(readlink -f "$0")")/../.." && pwd)
STATE_DIR=${STATE_DIR:-/var/lib/ckptd-one-node}
HOST=$(hostname -s)
SLURM_CONF=/etc/slurm/slurm.conf

say() { echo "one-node-cluster: $*" >&2; }
die() { say "$*"; exit 1; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
            && command -v sbatch >/dev/null && command -v munged >/dev/null; then
        return
    fi
    command -v apt-get >/dev/null || die "apt-get not found: install slurmd slurmctld slurm-client munge by hand"
    say "installing slurmd slurmctld slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_from() { cat "$1" 2>/dev/null || true; }

stop_pidfile() {
    # SIGTERM the daemon named by pid file $1 and wait (bounded) until it is gone.
    local pid
    pid=$(pid_from "$1")
    pid_alive "$pid" || return 0
    kill -TERM "$pid"
    for _ in $(seq 100); do
        pid_alive "$pid" && [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" != Z ] || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

start_munge() {
    mkdir -p /run/munge
    chown munge:munge /run/munge
    chmod 0755 /run/munge
    if pid_alive "$(pid_from /run/munge/munged.pid)"; then
        return
    fi
    [ -s /etc/munge/munge.key ] || die "/etc/munge/munge.key is missing (reinstall munge)"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 50); do
        munge -n >/dev/null 2>&1 && return
        sleep 0.1
    done
    die "munged did not start"
}

write_config() {
    local python ckptd_bin node_line
    mkdir -p "$STATE_DIR" /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
    chown slurm:slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
    python=$(command -v python3 || command -v python)
    ckptd_bin=${CKPTD_BIN:-$(dirname "$("$python" -c 'import sys; print(sys.executable)')")/ckptd}
    [ -x "$ckptd_bin" ] || die "ckptd executable not found at $ckptd_bin (pip install -e $REPO, or set CKPTD_BIN)"

    cat > "$STATE_DIR/ckptd-slurm.conf" <<CONF
# ckptd prolog/epilog configuration for the one-node test cluster (see ckptd-slurm-common.sh)
CKPTD_BIN=$ckptd_bin
CKPTD_ROOTS="${CKPTD_ROOTS:-/tmp}"
CKPTD_POOL_SIZE=${CKPTD_POOL_SIZE:-256M}
CKPTD_WRITERS=2
CKPTD_DRAIN_TIMEOUT=30
CKPTD_READY_TIMEOUT=120
CKPTD_LOG_FILE=/var/log/slurm/ckptd-prolog-epilog.log
CONF
    # slurm.conf can only name a script, so small wrappers point our scripts at that file.
    for kind in prolog epilog; do
        cat > "$STATE_DIR/$kind" <<WRAP
#!/bin/sh
CKPTD_CONF=$STATE_DIR/ckptd-slurm.conf exec $REPO/deploy/slurm/$kind.sh
WRAP
        chmod 0755 "$STATE_DIR/$kind"
    done

    # slurmd -C prints this node's real layout (CPUs, RealMemory): use it as is.
    node_line=$(slurmd -C | grep '^NodeName=' | head -n 1)
    [ -n "$node_line" ] || die "slurmd -C printed no NodeName line"
    cat > "$SLURM_CONF" <<CONF
# One-node cluster for ckptd tests, written by $REPO/deploy/slurm/one-node-cluster.sh
ClusterName=ckptd-one-node
SlurmctldHost=$HOST
SlurmUser=slurm
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
PrologFlags=Alloc
Prolog=$STATE_DIR/prolog
Epilog=$STATE_DIR/epilog
JobCompType=jobcomp/filetxt
JobCompLoc=/var/log/slurm/jobcomp.log
$node_line State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
}

wait_idle() {
    local state
    for _ in $(seq 300); do
        state=$(sinfo -h -n "$HOST" -o %T 2>/dev/null || true)
        case "$state" in
            idle*|mixed*|allocated*) say "node $HOST is $state"; return 0 ;;
            drain*|down*) scontrol update nodename="$HOST" state=resume 2>/dev/null || true ;;
        esac
        sleep 0.2
    done
    die "node $HOST did not become idle (state: ${state:-unknown}); see /var/log/slurm/"
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root"
    install_packages
    start_munge
    stop_pidfile /run/slurm/slurmd.pid
    stop_pidfile /run/slurm/slurmctld.pid
    write_config
    slurmctld
    slurmd
    wait_idle
}

down() {
    stop_pidfile /run/slurm/slurmd.pid
    stop_pidfile /run/slurm/slurmctld.pid
    stop_pidfile /run/munge/munged.pid
}

status() {
    for f in /run/munge/munged.pid /run/slurm/slurmctld.pid /run/slurm/slurmd.pid; do
        if pid_alive "$(pid_from "$f")"; then echo "$f: running"; else echo "$f: stopped"; fi
    done
    sinfo 2>/dev/null || true
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
