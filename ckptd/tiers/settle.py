"""What a tiered save leaves at its targets once its flush is over: the previous files.

A tiered save may replace files at its target (a torch file saved to the same path every
time, a DCP checkpoint saved again into its directory). Before the first copy attempt of
a file can rename onto the target, it hard-links the file there aside
(:func:`ckptd.storage.previous.keep_aside`, under the name the service gave the
:class:`ckptd.tiers.copy.FlushFile`). When the save's flush ends, :func:`settle` settles
its targets on a worker thread (the target may hang; the serve loop must not):

- the save is done: what was kept goes;
- it failed or was aborted: where the target holds one of this save's own files, the
  kept file is put back (or, where there was none, the save's file is removed); a file
  some later save put there stays.

A flush resumed from the journal (the daemon restarted) settles the earlier daemon's
attempts too: each attempt notes its file's id beside the local copy before it renames
(:meth:`ckptd.tiers.copy.FlushFile.note_attempt`), so the target's file is known as this
save's own even when a dead daemon renamed it, and the previous file it kept (under the
journaled name) is put back even when no attempt of this daemon got as far as keeping.

It does so only once every copy attempt of the save has returned, abandoned ones
included. An attempt is a thread, which nobody can kill, and one held inside a rename by
a hung target renames when the target answers: put back before that, the previous file
would be replaced again by that late rename (or keep the failed save's checksum record).
Meanwhile the flusher starts no copy to those targets
(:meth:`ckptd.tiers.flusher.Flusher.hold`), so settling never undoes a later save.

A DCP save's data files carry a token of their own in their names, so only its
``.metadata`` replaces a file at the target: its commit's flush keeps the previous one
the same way, dropped once committed and put back once the commit is given up.

Pattern: join the workers, then drop or put back. No sockets.
"""

from __future__ import annotations

import os
import threading

from ckptd.storage.durable import remove_written
from ckptd.storage.previous import drop_previous, restore_previous_of


class Settlements:
    """Settles the targets of each tiered flush (a save's, or a commit's) once, when it
    ends (serve loop side).

    Parameters
    ----------
    flusher : ckptd.tiers.flusher.Flusher
        Holds the targets while they are settled.
    """

    def __init__(self, flusher) -> None:
        self.flusher = flusher

    def done(self, job) -> None:
        """Every file of ``job`` (a :class:`ckptd.tiers.flusher.FlushJob`) is at its
        target: what it replaced there goes."""
        self._settle(job, failed=False)

    def failed(self, job) -> None:
        """``job``'s save or commit failed or was aborted: what it replaced goes back."""
        self._settle(job, failed=True)

    def _settle(self, job, failed: bool) -> None:
        if job.settled:  # a failed save is wound up twice (abort, then forget)
            return
        job.settled = True
        thread = settle(job.files, [t for s in job.states for t in s.tasks], failed)
        self.flusher.hold([f.target for f in job.files], thread)


def settle(files: list, tasks: list, failed: bool) -> threading.Thread:
    """Settle the targets of ``files`` once every one of ``tasks`` (the copy attempts, each
    a :class:`ckptd.tiers.copy.CopyTask`) has returned; returns the thread doing it."""
    thread = threading.Thread(target=_settle, args=(list(files), list(tasks), failed),
                              daemon=True, name="ckptd-flush-settle")
    thread.start()
    return thread


def _settle(files: list, tasks: list, failed: bool) -> None:
    for task in tasks:
        if task.thread is not None and task.thread is not threading.current_thread():
            task.thread.join()  # no timeout: until it returns, it may still rename
    for file in files:
        own = [t.file_id for t in tasks if t.file is file and t.file_id is not None]
        own += file.earlier
        if not failed:
            if file.previous:
                drop_previous(file.previous)
        elif _kept(file):
            restore_previous_of(file.target, file.previous, own)
        else:  # nothing was there before it: only its own file goes
            for file_id in own:
                remove_written(file.target, file_id)
            if file.previous:
                drop_previous(file.previous)  # a link that landed after the decision


def _kept(file) -> bool:
    if file.kept is not None:
        return file.kept
    # No attempt of this daemon got as far as keeping (a resumed flush whose deadline
    # passed while no daemon ran): the link is there only if the earlier daemon kept.
    return bool(file.previous) and os.path.lexists(file.previous)
