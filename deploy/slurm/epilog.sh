#!/bin/bash
# SLURM Epilog (slurm.conf: Epilog=/path/to/epilog.sh): stop this job's ckptd.
#
# Sends SIGTERM (the daemon refuses new saves and lets in-flight writes finish for up to
# its --drain-timeout), waits until the process is gone (a zombie counts as gone),
# SIGKILLs its process group after CKPTD_DRAIN_TIMEOUT + CKPTD_KILL_AFTER seconds, then
# removes the per-job directory and the job's metrics textfile. With
# ProctrackType=proctrack/linuxproc SLURM does not clean up what the prolog started, so
# this is the only thing that does. Always exits 0; problems go to `logger -t ckptd-epilog`.

set -u
CKPTD_LOG_TAG=ckptd-epilog  # read by ckptd_log in the common file
# shellcheck source=ckptd-slurm-common.sh disable=SC2034
. "$(dirname "$(readlink -f "$0")")/ckptd-slurm-common.sh"

[ -n "${SLURM_JOB_ID:-}" ] || { ckptd_log "SLURM_JOB_ID is not set; nothing to stop"; exit 0; }
if dir=$(ckptd_job_dir); then
    ckptd_stop "$dir" || ckptd_log "leaving $dir in place: its daemon did not stop"
    if ! { pid=$(ckptd_pid_of "$dir") && ckptd_is_running "$pid"; }; then
        rm -rf -- "$dir" || ckptd_log "could not remove $dir"
    fi
fi
if [ -n "${CKPTD_METRICS_DIR:-}" ]; then
    rm -f -- "$CKPTD_METRICS_DIR/ckptd-job-$SLURM_JOB_ID.prom"
fi
exit 0
