#!/bin/bash
# shellcheck disable=SC2015  # "A && B || soft_fail": soft_fail exits, as intended
# SLURM Prolog (slurm.conf: Prolog=/path/to/prolog.sh, PrologFlags=Alloc).
#
# Starts one ckptd per node for this job, as the job's user, with its socket in a
# per-job directory only that user can enter (mode 0700):
#     $CKPTD_RUN_BASE/job-$SLURM_JOB_ID/ckptd.sock     (/run/ckptd, else /tmp/ckptd-slurm)
# and writes $CKPTD_RUN_BASE/job-$SLURM_JOB_ID/env (CKPTD_SOCKET=...) for job scripts to
# source. Waits until the daemon is ready (its ready file names its pid).
#
# Runs as root. Never fails the node on a soft error: problems are logged through
# `logger -t ckptd-prolog` and the prolog exits 0, so the job runs (without a daemon;
# trainers then get DaemonUnavailableError or auto-start one). CKPTD_PROLOG_STRICT=1
# makes a failed start drain the node instead.
#
# The daemon is started with start-stop-daemon --background: it forks, calls setsid and
# execs, so the daemon is out of the prolog's process group before the prolog exits
# (slurmd kills that group), and its stdio goes to a log file (slurmd would otherwise
# wait for the prolog's output to close). Configuration: see ckptd-slurm-common.sh.

set -u
CKPTD_LOG_TAG=ckptd-prolog  # read by ckptd_log in the common file
# shellcheck source=ckptd-slurm-common.sh disable=SC2034
. "$(dirname "$(readlink -f "$0")")/ckptd-slurm-common.sh"

soft_fail() {
    ckptd_log "$*; the job runs without a prolog-started ckptd"
    [ "$CKPTD_PROLOG_STRICT" = 1 ] && exit 1
    exit 0
}

[ -n "${SLURM_JOB_ID:-}" ] || soft_fail "SLURM_JOB_ID is not set (not run by slurmd?)"
[ -n "${SLURM_JOB_USER:-}" ] || soft_fail "SLURM_JOB_USER is not set"
uid=${SLURM_JOB_UID:-$(id -u "$SLURM_JOB_USER" 2>/dev/null)} \
    || soft_fail "unknown user $SLURM_JOB_USER"
gid=$(id -g "$SLURM_JOB_USER" 2>/dev/null) || soft_fail "unknown user $SLURM_JOB_USER"
home=$(getent passwd "$SLURM_JOB_USER" | cut -d: -f6)
[ -x "$CKPTD_BIN" ] || soft_fail "ckptd executable $CKPTD_BIN not found (set CKPTD_BIN in $CKPTD_CONF)"

base=$(ckptd_run_base) || soft_fail "no usable runtime directory (tried ${CKPTD_RUN_BASE:-/run/ckptd /tmp/ckptd-slurm})"
dir=$base/job-$SLURM_JOB_ID
sock=$dir/ckptd.sock
[ "${#sock}" -le 107 ] || soft_fail "socket path $sock is longer than 107 bytes (set CKPTD_RUN_BASE shorter)"

# A requeued job keeps its id: stop and clear what an earlier run left.
if [ -e "$dir" ] || [ -L "$dir" ]; then
    [ -d "$dir" ] && [ ! -L "$dir" ] && ckptd_stop "$dir"
    rm -rf -- "$dir"
fi
mkdir -m 0700 "$dir" && chown "$uid:$gid" "$dir" \
    || soft_fail "cannot create $dir owned by $SLURM_JOB_USER"

roots=${CKPTD_ROOTS:-$home}
[ -n "${SLURM_JOB_WORK_DIR:-}" ] && roots="$roots $SLURM_JOB_WORK_DIR"
args=(serve --socket "$sock" --pool-size "$CKPTD_POOL_SIZE" --writers "$CKPTD_WRITERS"
      --drain-timeout "$CKPTD_DRAIN_TIMEOUT" --log-level "$CKPTD_LOG_LEVEL")
for root in $roots; do
    args+=(--root "$root")
done
if [ -n "${CKPTD_LOCAL_DIR:-}" ]; then
    local_dir=${CKPTD_LOCAL_DIR//%j/$SLURM_JOB_ID}
    mkdir -p "$local_dir" && chown "$uid:$gid" "$local_dir" && chmod 0700 "$local_dir" \
        || soft_fail "cannot create the local checkpoint directory $local_dir"
    args+=(--local-dir "$local_dir")
fi
if [ -n "${CKPTD_POOL_DIR:-}" ]; then
    args+=(--pool-dir "$CKPTD_POOL_DIR")
fi
if [ -n "${CKPTD_PEER_LISTEN:-}" ]; then
    args+=(--peer-listen "$CKPTD_PEER_LISTEN")
fi
if [ -n "${CKPTD_METRICS_DIR:-}" ]; then
    args+=(--metrics-textfile "$CKPTD_METRICS_DIR/ckptd-job-$SLURM_JOB_ID.prom"
           --metrics-label "slurm_job_id=$SLURM_JOB_ID")
fi
# shellcheck disable=SC2206  # word splitting of the operator's extra arguments is wanted
args+=(${CKPTD_EXTRA_ARGS:-})

# The daemon writes its log (and its "ckptd ready" line) to $dir/ckptd.log.
if ! start-stop-daemon --start --background --make-pidfile --pidfile "$dir/ckptd.pid" \
        --chuid "$uid:$gid" --chdir "$dir" --output "$dir/ckptd.log" \
        --startas "$CKPTD_BIN" -- "${args[@]}" </dev/null >/dev/null 2>&1; then
    soft_fail "start-stop-daemon could not start $CKPTD_BIN"
fi

ready_pid() {
    # The pid in the daemon's ready file, if the file is complete (written atomically).
    sed -n 's/.*"pid": *\([0-9][0-9]*\).*/\1/p' "$dir/ckptd.ready" 2>/dev/null
}

deadline=$((SECONDS + CKPTD_READY_TIMEOUT))
pid=""
while [ "$SECONDS" -lt "$deadline" ]; do
    pid=$(ckptd_pid_of "$dir") && [ "$(ready_pid)" = "$pid" ] && break
    if [ -n "$pid" ] && ! ckptd_is_running "$pid"; then
        soft_fail "ckptd exited before it was ready: $(tail -n 3 "$dir/ckptd.log" 2>/dev/null | tr '\n' ' ')"
    fi
    pid=""
    sleep 0.2
done
if [ -z "$pid" ]; then
    pid=$(ckptd_pid_of "$dir") && ckptd_stop "$dir"
    soft_fail "ckptd was not ready within ${CKPTD_READY_TIMEOUT}s (log: $dir/ckptd.log)"
fi

printf 'CKPTD_SOCKET=%s\n' "$sock" > "$dir/env.tmp" && chown "$uid:$gid" "$dir/env.tmp" \
    && chmod 0644 "$dir/env.tmp" && mv -f "$dir/env.tmp" "$dir/env" \
    || soft_fail "cannot write $dir/env"
ckptd_log "ckptd pid $pid ready for user $SLURM_JOB_USER on $sock"
exit 0
