"""Tiered checkpoints: node-local first, then the target (``ckptd serve --stage-dir``).

With a stage directory, a save to a checkpoint root is made durable on node-local storage
first (the writers write there exactly as they would write the target), its staging
extent goes back to the pool, and the daemon copies each file to its target in the
background; a checkpoint's commit (a DCP ``.metadata``, a torch file's final name) appears
at the target only once every file it needs is durable there.

Modules, one job each:

- :mod:`ckptd.tiers.stage` -- the stage directory: where each save's local copy lives,
  the byte budget (back-pressure), and the journal a restarted daemon resumes from;
- :mod:`ckptd.tiers.copy` -- one file copy to the target, run on a worker thread
  (verified, fsync, rename, directory fsync), and how its errors are classified;
- :mod:`ckptd.tiers.flusher` -- copies of every save: bounded parallelism, backoff,
  stalls, deadlines, progress for ``ckptd status``;
- :mod:`ckptd.tiers.service` -- the serve loop's side: which requests are tiered, their
  flushes, resuming from the journal, retention;
- :mod:`ckptd.tiers.admission` -- the stage budget's gate: STAGEs reserved, parked in
  arrival order, or refused (each refused one hands back what it brought);
- :mod:`ckptd.tiers.commits` -- the commits of DCP checkpoints (each ``.metadata``),
  pending until every file they name is durable at the target;
- :mod:`ckptd.tiers.settle` -- the files a save (or a commit's ``.metadata``) replaced at
  its target: dropped once it is done, put back once it failed, each only after all its
  copies have returned.

Nothing here runs on the serve loop's thread except the bookkeeping: every call that
touches the target (which may stall for minutes) runs on a worker thread.
"""
