"""Async requests and the queue that finalizes them in order, together, on every rank.

- :mod:`~ckpt_client.queue.request` — ``AsyncRequest``: the work and its finalize functions
- :mod:`~ckpt_client.queue.runners` — the ``Runner`` protocol (``poll``, ``cleanup``,
  ``abort``) and its implementations: saves in the daemon, a forked helper, nothing
- :mod:`~ckpt_client.queue.calls_queue` — ``AsyncCallsQueue``: order, the completion
  agreement, finalize; ``abort_async_checkpoints``
- :mod:`~ckpt_client.queue.guard` — ``guard_optimizer``: the step waits for staging
- :mod:`~ckpt_client.queue.gcpause` — no cyclic garbage collection inside a save call
"""
