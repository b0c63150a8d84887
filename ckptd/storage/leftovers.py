"""Temporaries of writers that died: where they can be, whether they are dead, sweeping them.

A writer (or the daemon itself) killed mid-file leaves its hidden temporary behind. Three
facts make sweeping it safe:

- its name says whose it was (``.<name>.<pid>.<token>.ckptd-tmp``,
  :func:`ckptd.storage.durable.temporary_name`);
- every live writer holds an exclusive ``flock`` on its temporary until the file has its
  final name, so a temporary whose lock can be taken has no writer any more, whichever
  daemon it belonged to: nobody's live file is ever removed;
- each daemon keeps a journal, in its private runtime directory, of the directories it
  writes into and of its writer processes (:class:`WrittenDirectories`); a daemon started
  at the same socket after a crash sweeps the directories in its predecessors' journals.

A predecessor's journal is swept and removed only once the predecessor and every writer it
named are gone: a writer still dying (a kill just before the restart; a writer finishing
an fsync) holds its temporary's lock, and a journal removed then would leave that
temporary to nobody. Until then the journal stays, and the successor sweeps again later
(:class:`ckptd.server.predecessors.PredecessorSweeper`).

The writer pool sweeps a dead writer's directories when it reaps it; the daemon sweeps its
predecessors'. A planted link at a temporary-looking name is never followed and never
removed.
"""

from __future__ import annotations

import errno as errno_mod
import fcntl
import logging
import os
import re
import threading

from ckptd.checksum import TMP_MARKER
from ckptd.protocol import process_alive

log = logging.getLogger(__name__)

_JOURNAL_RE = re.compile(r"ckptd\.(\d+)\.dirs")


def _sweep_one(name: str, dir_fd: int) -> bool:
    """Remove temporary ``name`` if no process holds its lock; True if removed."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return False  # gone already, or a link (never followed, never ours to remove)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno_mod.EWOULDBLOCK, errno_mod.EAGAIN):
            return False  # a live writer holds it
        raise
    try:
        if os.fstat(fd).st_ino != os.lstat(name, dir_fd=dir_fd).st_ino:
            return False  # replaced meanwhile: not the file we proved dead
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_temporaries(directory: str, pid: int | None = None, recursive: bool = False,
                      name_prefix: str = ".") -> list[str]:
    """Remove the temporaries in ``directory`` whose writer is gone.

    Parameters
    ----------
    pid : int, optional
        Only temporaries that this process wrote.
    recursive : bool
        Also in every directory below (not following links).
    name_prefix : str
        Only temporaries whose name starts so (``.<file>.``: those of one file).

    Returns
    -------
    list of str
        The paths removed.
    """
    removed = []
    for current, subdirs, names in os.walk(directory) if recursive else [(directory, [], None)]:
        try:
            dir_fd = os.open(current, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            for name in names if names is not None else os.listdir(dir_fd):
                if not name.startswith(name_prefix) or not name.endswith(TMP_MARKER):
                    continue
                if pid is not None and f".{pid}." not in name:
                    continue
                if _sweep_one(name, dir_fd):
                    removed.append(os.path.join(current, name))
        finally:
            os.close(dir_fd)
    if removed:
        log.info("removed %d temporary file(s) of writers that died: %s", len(removed),
                 ", ".join(removed[:5]) + (" ..." if len(removed) > 5 else ""))
    return removed


class WrittenDirectories:
    """The journal of directories this daemon writes into, kept in its runtime directory.

    Parameters
    ----------
    runtime_dir : str
        The daemon's private directory (beside its socket); kept across restarts.
    """

    def __init__(self, runtime_dir: str) -> None:
        self.path = os.path.join(runtime_dir, f"ckptd.{os.getpid()}.dirs")
        self._seen: set = set()
        self._lock = threading.Lock()  # the serve loop and the replicator thread note
        self._file = open(self.path, "a", encoding="utf-8")

    def note_process(self, pid: int) -> None:
        """Remember a writer process: its temporaries are swept once it, too, is gone."""
        self._write(f"P {pid}")

    def note(self, directory: str, recursive: bool = False) -> None:
        """Remember that temporaries may appear in ``directory`` (and below)."""
        self._write(("R " if recursive else "D ") + directory)

    def _write(self, entry: str) -> None:
        with self._lock:
            if entry in self._seen:
                return
            self._seen.add(entry)
            self._file.write(entry + "\n")
            self._file.flush()  # a SIGKILL must not lose it; page cache outlives us

    def close(self) -> None:
        """A clean stop left no temporaries: the journal goes."""
        self._file.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @staticmethod
    def sweep_predecessors(runtime_dir: str) -> tuple[list[str], list[int]]:
        """Sweep the directories of earlier daemons at this socket that did not stop cleanly.

        Returns
        -------
        (list of str, list of int)
            The temporaries removed, and the predecessors whose journal waits for a later
            sweep (they, or a writer they named, still run).
        """
        removed, waiting = [], []
        for name in os.listdir(runtime_dir):
            match = _JOURNAL_RE.fullmatch(name)
            if not match or int(match.group(1)) == os.getpid():
                continue
            journal = os.path.join(runtime_dir, name)
            try:
                with open(journal, encoding="utf-8", errors="replace") as f:
                    entries = [line.rstrip("\n") for line in f if line[:2] in ("R ", "D ", "P ")]
            except FileNotFoundError:
                continue  # swept by a sibling meanwhile
            owners = [int(match.group(1))] + [int(e[2:]) for e in entries
                                               if e.startswith("P ") and e[2:].isdigit()]
            if any(process_alive(pid) for pid in owners):
                waiting.append(owners[0])
                continue
            for entry in entries:
                if not entry.startswith("P "):
                    removed += sweep_temporaries(entry[2:], recursive=entry.startswith("R "))
            os.unlink(journal)
            log.info("swept the directories of an earlier ckptd (pid %s) at this socket",
                     match.group(1))
        return removed, waiting
