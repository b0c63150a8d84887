"""Writers stuck in the kernel: how a stall is named, and who keeps the stuck process.

A write or fsync to a hung storage target (a starved Lustre OST, a dead NFS server, a
FUSE server that stopped answering) blocks its writer process in the kernel; even SIGKILL
only takes effect when the call returns. The daemon cannot end such a write, so it gives
up on it: the save fails, the writer is killed (so it runs no more code of its own) and
replaced, and the killed process is kept here until it has really exited. A call it had
already made may still land when the storage wakes up (a rename held by the target
completes then), so until the process is gone its file stays busy and nothing it might
still touch is changed: its job's ``release`` (the hold on the extent, and putting back
the file the job replaced) is called only when the process is gone.

Owns :class:`StuckWriters`; :func:`storage_target`, :func:`stall_message` and
:func:`deadline_message` say where and how a file stalled or overstayed. No zmq sends, no
scheduling: the writer pool decides when.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

from ckptd.storage.jobs import WriteJob
from ckptd.storage.leftovers import sweep_temporaries
from ckptd.storage.previous import kept_record_name

log = logging.getLogger(__name__)


def storage_target(path: str) -> str:
    """The mount a file lives on, as an operator names it: ``/mnt/lustre (lustre
    10.0.0.1@tcp:/fs)``; the mount point alone when the mount table cannot be read."""
    best = ("/", "", "")
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                if " - " not in line or len(fields) < 5:
                    continue
                mount_point = fields[4].replace("\\040", " ")
                fs_type, source = line.split(" - ", 1)[1].split()[:2]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best[0]):
                    best = (mount_point, fs_type, source)
    except OSError:
        pass
    mount_point, fs_type, source = best
    return f"{mount_point} ({fs_type} {source})" if fs_type else mount_point


def stall_message(job: WriteJob, waited: float, timeout: float, pid: int) -> str:
    """Why a stalled job failed: file, phase, target, how long, and what to do."""
    phase = repr(job.phase) + (" (sent to the writer, never started)"
                               if job.phase == "queued" else "")
    return (f"stalled in phase {phase} on storage "
            f"{storage_target(job.path)}: no progress for {waited:.0f}s ({job.bytes_done} "
            f"of {job.nbytes} bytes written; the limit is --stall-timeout {timeout:g}s). "
            f"The writer (pid {pid}) stopped answering, as a write stuck in the kernel does; "
            f"it was replaced and keeps its staging space until it returns. The previous "
            f"checkpoint is intact: check that storage target, then save again")


def deadline_message(job: WriteJob, pid: int | None) -> str:
    """Why a job failed by its own deadline (``pid``: the writer replaced, or None if it
    never reached one)."""
    where = ("still waiting for a free writer" if pid is None else
             f"in phase {job.phase!r} ({job.bytes_done} of {job.nbytes} bytes written); its "
             f"writer (pid {pid}) was replaced; should a call of it still land, the file "
             f"is removed or the previous one put back once that process exits")
    return (f"not durable within {job.deadline_of} of its request on storage "
            f"{storage_target(job.path)}: {where}. The previous checkpoint is intact: check "
            f"that storage target and the daemon's writers (ckptd status), then save again")


@dataclass
class StuckWriter:
    """A writer process given up on, kept until it has really exited."""

    process: subprocess.Popen
    job: WriteJob
    close_socket: Callable[[], None]
    release: Callable[[], None] | None
    since: float = field(default_factory=time.time)

    def describe(self) -> dict:
        """Its entry in status's ``stuck_writers``."""
        return {"pid": self.process.pid, "path": self.job.path, "phase": self.job.phase,
                "bytes_done": self.job.bytes_done, "bytes_total": self.job.nbytes,
                "since": self.since, "stuck_for_s": time.time() - self.since}


class StuckWriters:
    """Writers given up on, until each one exits (then its leftovers go and its extent is
    free)."""

    def __init__(self) -> None:
        self.writers: list[StuckWriter] = []

    def add(self, process: subprocess.Popen, job: WriteJob,
            close_socket: Callable[[], None]) -> None:
        """Kill ``process`` (it dies when its call returns) and keep it until it has."""
        try:
            process.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
        release = job.on_stuck(job, process.pid) if job.on_stuck is not None else None
        self.writers.append(StuckWriter(process, job, close_socket, release))

    def paths(self) -> set[str]:
        """The files the stuck writers were writing (busy until each writer exits)."""
        return {w.job.path for w in self.writers}

    def reap(self) -> bool:
        """Let go of those that exited: remove their temporaries, free their extents.
        Returns whether any had."""
        exited = [w for w in self.writers if w.process.poll() is not None]
        for stuck in exited:
            self.writers.remove(stuck)
            log.warning("stuck writer (pid %d) returned after %.0fs; its staging space is free "
                        "again", stuck.process.pid, time.time() - stuck.since)
            sweep_temporaries(os.path.dirname(stuck.job.path), stuck.process.pid)
            stuck.close_socket()
            if stuck.release is not None:
                stuck.release()
        return bool(exited)

    def describe(self) -> list[dict]:
        """Status entries, oldest first."""
        return [w.describe() for w in self.writers]

    def abandon(self) -> None:
        """At shutdown: they cannot be waited for; the kernel ends them when storage answers.

        The file a stuck job replaces cannot be put back now (its late rename may still
        land, and the hung target would block the shutdown), and its kept link is a
        temporary the next daemon's sweep removes: the operator is told where it is, at
        error level, to put it back by hand. It stays sweepable: after a daemon crash such
        links are garbage beside a whole file, and kept out of the sweep they would pile up.
        """
        for stuck in self.writers:
            kept = getattr(stuck.job.body, "previous", "")
            if kept and stuck.release is not None:
                log.error("writer pid %d is still stuck writing %s at shutdown. The file it "
                          "replaces may be kept at %s (its checksum record at %s); once the "
                          "storage answers, if %s does not hold the previous checkpoint, "
                          "rename those back before the next daemon starts: its sweep of "
                          "temporaries removes them", stuck.process.pid, stuck.job.path,
                          kept, kept_record_name(kept), stuck.job.path)
            else:
                log.warning("writer pid %d is still stuck writing %s; leaving it to exit when "
                            "the storage answers", stuck.process.pid, stuck.job.path)
            stuck.close_socket()
        self.writers = []

