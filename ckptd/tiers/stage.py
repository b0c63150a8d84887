"""The stage directory: local copies of tiered saves, their byte budget, and the journal.

Layout under ``--stage-dir``::

    saves/<key>/<file>      the local copy of each file of one save (and its checksum record)
    journal/<key>.json      what must still reach the target, durable before the flush starts

``<key>`` names one save of one rank (daemon incarnation + request id) or one commit
(``commit-`` + a digest of the checkpoint path). A journal entry is written (temp, fsync,
rename) before the first byte is copied and removed only after the flush has ended and the
local copy is gone, so a daemon killed at any moment finds every unfinished flush at its
next start; a ``saves/`` directory without a journal entry is a save that was never handed
to the flusher, and is removed.

Owns the budget too: bytes reserved for saves admitted but not yet flushed and removed.
A save that would exceed it waits or is refused (``--stage-policy``), so the local disk
never fills. Runs on the serve loop's thread (the stage directory is local and fast).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil

from ckptd import knobs
from ckptd.storage.directories import make_directories
from ckptd.storage.durable import remove_quietly, write_small_file

log = logging.getLogger(__name__)

#: Room reserved per file beyond its tensor bytes (archive headers, checksum record).
FILE_OVERHEAD = 64 << 10
#: Room reserved per buffer (a DCP item's zip records).
ITEM_OVERHEAD = 4 << 10


def default_budget(stage_dir: str) -> int:
    """:data:`knobs.STAGE_BUDGET_FRACTION` of the stage filesystem's free space now."""
    info = os.statvfs(stage_dir)
    return int(info.f_bavail * info.f_frsize * knobs.STAGE_BUDGET_FRACTION.get())


def commit_key(target: str) -> str:
    """The key of the commit of checkpoint ``target``."""
    return "commit-" + hashlib.sha256(target.encode()).hexdigest()[:20]


class StageDir:
    """Where tiered saves live locally (see the module docstring).

    Parameters
    ----------
    path : str
        ``--stage-dir`` (created if missing; resolved, since the writers follow no link).
    budget : int or None
        ``--stage-budget`` in bytes; None: :func:`default_budget`.
    """

    def __init__(self, path: str, budget: int | None) -> None:
        make_directories(os.path.realpath(path))
        self.path = os.path.realpath(path)
        self.saves_dir = os.path.join(self.path, "saves")
        self.journal_dir = os.path.join(self.path, "journal")
        for directory in (self.saves_dir, self.journal_dir):
            make_directories(directory)
        self.budget = budget if budget is not None else default_budget(self.path)
        self._reserved: dict[str, int] = {}

    # ------------------------------------------------------------------ budget
    @property
    def used_bytes(self) -> int:
        """Bytes reserved by saves not flushed and removed yet."""
        return sum(self._reserved.values())

    @staticmethod
    def need(nbytes: int, files: int, buffers: int) -> int:
        """Bytes to reserve for a save of ``nbytes`` in ``files`` files of ``buffers`` items."""
        return nbytes + FILE_OVERHEAD * max(files, 1) + ITEM_OVERHEAD * buffers

    def fits(self, need: int) -> bool:
        """Whether ``need`` more bytes fit the budget now (an empty stage takes anything
        no larger than the budget)."""
        return self.used_bytes + need <= self.budget

    def reserve(self, key: str, need: int) -> None:
        """Hold ``need`` bytes for save ``key``."""
        self._reserved[key] = self._reserved.get(key, 0) + need

    def release(self, key: str) -> bool:
        """Give back what ``key`` held; True if it held anything."""
        return self._reserved.pop(key, None) is not None

    # ------------------------------------------------------------------ local copies
    def local_dir(self, key: str) -> str:
        """The directory of save ``key``'s local files."""
        return os.path.join(self.saves_dir, key)

    def remove_local(self, key: str) -> None:
        """Delete save ``key``'s local files (flushed, or the save failed)."""
        shutil.rmtree(self.local_dir(key), ignore_errors=True)

    # ------------------------------------------------------------------ journal
    def _entry_path(self, key: str) -> str:
        return os.path.join(self.journal_dir, f"{key}.json")

    def record(self, key: str, entry: dict) -> None:
        """Make ``entry`` durable in the journal (replacing an earlier one of ``key``)."""
        write_small_file(self._entry_path(key), json.dumps(entry).encode())

    def forget(self, key: str) -> None:
        """Remove ``key``'s journal entry (its flush has ended)."""
        remove_quietly(self._entry_path(key))

    def entries(self) -> dict[str, dict]:
        """Unfinished flushes a previous daemon left, by key (unreadable entries are
        logged and skipped: their local copies cannot be trusted to go anywhere)."""
        found = {}
        for name in sorted(os.listdir(self.journal_dir)):
            if not name.endswith(".json"):
                continue
            key = name[:-len(".json")]
            try:
                with open(os.path.join(self.journal_dir, name)) as f:
                    found[key] = json.load(f)
            except (OSError, ValueError) as exc:
                log.error("journal entry %s is unreadable (%s); its save is not resumed",
                          name, exc)
        return found

    def sweep(self, keep: set[str]) -> None:
        """Remove local copies no journal entry names, and leftover temporaries."""
        for name in os.listdir(self.saves_dir):
            if name not in keep:
                log.info("removing %s from the stage directory: it never reached the "
                         "flusher", name)
                self.remove_local(name)
        for name in os.listdir(self.journal_dir):
            if not name.endswith(".json"):
                remove_quietly(os.path.join(self.journal_dir, name))
