"""Retention that knows durability: ``ckptd serve --keep-last N``.

Owns the list of checkpoints this daemon committed at their targets, per checkpoint
directory's parent (``stage-dir/retention.json``, replaced atomically), and deletes the
oldest beyond the newest ``N`` of each parent. Because an entry is added only once its
checkpoint is committed whole at the target, a checkpoint is deleted only after ``N``
newer ones are durable there: never the only copy, never one whose successor is not yet
durable. A path a save is still writing or flushing to is never touched (it stays on the
list and is looked at again after the next commit). Only what ckptd committed is listed;
nothing else in the directory is ever deleted.

Deleting runs on a worker thread (the target may hang); a DCP checkpoint loses its
``.metadata`` first, so it is invisible before any of its files goes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from typing import Callable

from ckptd.storage.durable import write_small_file
from ckptd.tiers.copy import remove_at_target

log = logging.getLogger(__name__)


def delete_checkpoint(entry: dict) -> None:
    """Remove one committed checkpoint: its commit first, then its files."""
    path = entry["path"]
    if entry["kind"] == "dcp":
        remove_at_target([os.path.join(path, ".metadata")])
        names = entry["files"] or [n for n in _listdir(path) if n.endswith(".distcp")]
        remove_at_target([os.path.join(path, name) for name in names])
        try:
            os.rmdir(path)
        except OSError:
            pass  # something else lives there too: left alone
    else:
        remove_at_target([path])
    log.info("retention: deleted %s (older than the newest kept)", path)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


class Retention:
    """Keep the newest ``keep_last`` committed checkpoints of each parent directory.

    Parameters
    ----------
    record_path : str
        Where the list is kept (in the stage directory).
    keep_last : int
        Checkpoints kept per parent directory (at least 1).
    in_flight : callable
        ``in_flight(path) -> bool``: a save or commit to ``path`` is still under way.
    """

    def __init__(self, record_path: str, keep_last: int,
                 in_flight: Callable[[str], bool]) -> None:
        if keep_last < 1:
            raise ValueError(f"--keep-last must be at least 1, not {keep_last}")
        self.record_path = record_path
        self.keep_last = keep_last
        self.in_flight = in_flight
        try:
            with open(record_path) as f:
                self.committed: dict[str, list] = json.load(f)
        except (OSError, ValueError):
            self.committed = {}

    def committed_one(self, path: str, kind: str, files: list) -> None:
        """Checkpoint ``path`` (``dcp`` or ``torch``) is committed whole at its target."""
        parent = os.path.dirname(path)
        entries = [e for e in self.committed.get(parent, []) if e["path"] != path]
        entries.append({"path": path, "kind": kind, "files": list(files)})
        doomed = [e for e in entries[:-self.keep_last] if not self.in_flight(e["path"])]
        self.committed[parent] = [e for e in entries if e not in doomed]
        write_small_file(self.record_path, json.dumps(self.committed).encode())
        if doomed:
            threading.Thread(target=lambda: [delete_checkpoint(e) for e in doomed],
                             daemon=True, name="ckptd-retention").start()
