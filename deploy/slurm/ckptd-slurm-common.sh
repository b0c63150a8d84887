# shellcheck shell=bash
# Shared by prolog.sh and epilog.sh (sourced, not run): configuration and helpers.
#
# Configuration comes from a shell file, $CKPTD_CONF (default /etc/ckptd/slurm.conf),
# with these variables (all optional):
#   CKPTD_BIN            ckptd executable                  (default: `command -v ckptd`)
#   CKPTD_RUN_BASE       parent of per-job socket dirs     (default: /run/ckptd, else /tmp/ckptd-slurm)
#   CKPTD_ROOTS          allowed checkpoint roots, space separated (default: the job
#                        user's home directory, plus SLURM_JOB_WORK_DIR when slurmd sets it)
#   CKPTD_LOCAL_DIR      node-local checkpoint directory; "%j" becomes the job id
#   CKPTD_PEER_LISTEN    --peer-listen address for replication between the job's
#                        daemons, e.g. tcp://0.0.0.0:* (any free port; the daemon
#                        advertises the node's address)          (default: none)
#   CKPTD_POOL_SIZE      staging pool size                 (default: 1G)
#   CKPTD_POOL_DIR       tmpfs directory of the staging pool, e.g. a tmpfs mounted with
#                        huge=within_size,mode=1777 (docs/operations.md)  (default: /dev/shm)
#   CKPTD_WRITERS        writer processes                  (default: 2)
#   CKPTD_DRAIN_TIMEOUT  seconds to drain on stop          (default: 60)
#   CKPTD_READY_TIMEOUT  seconds the prolog waits          (default: 90)
#   CKPTD_KILL_AFTER     extra seconds before SIGKILL      (default: 15)
#   CKPTD_METRICS_DIR    node-exporter textfile directory  (default: none)
#   CKPTD_LOG_LEVEL      daemon log level                  (default: INFO)
#   CKPTD_LOG_FILE       also append prolog/epilog messages here (default: syslog only)
#   CKPTD_EXTRA_ARGS     more `ckptd serve` arguments      (default: none)
#   CKPTD_PROLOG_STRICT  1: fail the prolog (drain the node) when ckptd cannot start
#                        (default: 0, the job runs without a prolog-started daemon)

CKPTD_CONF=${CKPTD_CONF:-/etc/ckptd/slurm.conf}
if [ -r "$CKPTD_CONF" ]; then
    # shellcheck source=/dev/null
    . "$CKPTD_CONF"
fi
CKPTD_BIN=${CKPTD_BIN:-$(command -v ckptd || echo /usr/local/bin/ckptd)}
CKPTD_POOL_SIZE=${CKPTD_POOL_SIZE:-1G}
CKPTD_WRITERS=${CKPTD_WRITERS:-2}
CKPTD_DRAIN_TIMEOUT=${CKPTD_DRAIN_TIMEOUT:-60}
CKPTD_READY_TIMEOUT=${CKPTD_READY_TIMEOUT:-90}
CKPTD_KILL_AFTER=${CKPTD_KILL_AFTER:-15}
CKPTD_LOG_LEVEL=${CKPTD_LOG_LEVEL:-INFO}
CKPTD_PROLOG_STRICT=${CKPTD_PROLOG_STRICT:-0}

ckptd_log() {
    # To syslog; when there is none (no /dev/log) the line still reaches CKPTD_LOG_FILE
    # if set, and stderr (which slurmd discards).
    local line="job ${SLURM_JOB_ID:-?}: $*"
    if [ -n "${CKPTD_LOG_FILE:-}" ]; then
        echo "$(date '+%Y-%m-%dT%H:%M:%S') $CKPTD_LOG_TAG: $line" >> "$CKPTD_LOG_FILE" 2>/dev/null
    fi
    logger -t "$CKPTD_LOG_TAG" -- "$line" 2>/dev/null || echo "$CKPTD_LOG_TAG: $line" >&2
}

ckptd_run_base() {
    # /run is tmpfs and root-only on most nodes; fall back to /tmp where it is unusable.
    local base
    for base in ${CKPTD_RUN_BASE:-/run/ckptd /tmp/ckptd-slurm}; do
        if mkdir -p "$base" 2>/dev/null && [ -d "$base" ] && [ ! -L "$base" ] \
                && [ "$(stat -c %u "$base")" = 0 ] && chmod 0755 "$base" 2>/dev/null; then
            echo "$base"
            return 0
        fi
    done
    return 1
}

ckptd_job_dir() {
    # The existing per-job directory, searching every candidate base (for the epilog).
    local base
    for base in ${CKPTD_RUN_BASE:-/run/ckptd /tmp/ckptd-slurm}; do
        if [ -d "$base/job-$SLURM_JOB_ID" ] && [ ! -L "$base/job-$SLURM_JOB_ID" ]; then
            echo "$base/job-$SLURM_JOB_ID"
            return 0
        fi
    done
    return 1
}

ckptd_is_running() {
    # True if pid $1 exists and is not a zombie (a killed daemon stays a zombie until
    # PID 1 reaps it, and kill -0 still succeeds on a zombie).
    local state
    state=$(ps -o stat= -p "$1" 2>/dev/null) || return 1
    case "$state" in Z*|X*|"") return 1 ;; esac
    return 0
}

ckptd_pid_of() {
    # The daemon pid recorded in job dir $1 (pid file written by start-stop-daemon).
    local pid
    pid=$(cat "$1/ckptd.pid" 2>/dev/null) || return 1
    case "$pid" in ''|*[!0-9]*) return 1 ;; esac
    echo "$pid"
}

ckptd_stop() {
    # Stop the daemon of job dir $1: SIGTERM (it drains in-flight writes for up to
    # CKPTD_DRAIN_TIMEOUT), then SIGKILL to its process group after CKPTD_KILL_AFTER more.
    local dir=$1 pid pgid uid deadline
    pid=$(ckptd_pid_of "$dir") || return 0
    ckptd_is_running "$pid" || return 0
    uid=$(stat -c %u "$dir")
    # start-stop-daemon --background forks twice around setsid: the daemon is not the
    # group leader, so its group (writers included) is looked up, not assumed to be $pid.
    pgid=$(ps -o pgid= -p "$pid" | tr -d ' ')
    kill -TERM "$pid" 2>/dev/null
    deadline=$((SECONDS + CKPTD_DRAIN_TIMEOUT + CKPTD_KILL_AFTER))
    while ckptd_is_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
        sleep 0.2
    done
    if ckptd_is_running "$pid"; then
        ckptd_log "ckptd pid $pid still running after $((CKPTD_DRAIN_TIMEOUT + CKPTD_KILL_AFTER))s; SIGKILL to its process group $pgid"
        if [ -n "$pgid" ] && [ "$pgid" -gt 1 ] && [ "$pgid" != "$(ps -o pgid= -p $$ | tr -d ' ')" ]; then
            kill -KILL -- "-$pgid" 2>/dev/null
        fi
        kill -KILL "$pid" 2>/dev/null
        deadline=$((SECONDS + 10))
        while ckptd_is_running "$pid" && [ "$SECONDS" -lt "$deadline" ]; do
            sleep 0.2
        done
        # A killed daemon cannot unlink its shared-memory staging pool.
        rm -f "${CKPTD_POOL_DIR:-/dev/shm}"/ckptd-"$uid"-"$pid"-* 2>/dev/null
    fi
    if ckptd_is_running "$pid"; then
        ckptd_log "ckptd pid $pid survived SIGKILL; leaving it"
        return 1
    fi
    ckptd_log "ckptd pid $pid stopped"
    return 0
}
