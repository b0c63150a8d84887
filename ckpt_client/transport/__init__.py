"""The way from a trainer process to its node's daemon, and its bytes into the daemon's pool.

Shared by every front-end (torch format, DCP, the Megatron flow, local checkpoints);
knows no checkpoint format. The modules:

- :mod:`~ckpt_client.transport.connection` — ``connect()``, the registered connection,
  typed requests, what to do when the daemon died
- :mod:`~ckpt_client.transport.autostart` — starting one daemon per node when none answers
- :mod:`~ckpt_client.transport.flatten` — a state dict as a msgpack skeleton and buffers
- :mod:`~ckpt_client.transport.handover` — staging one save: reserve, copy, confirm (inline
  or on the connection's background thread)
- :mod:`~ckpt_client.transport.daemon_save` — the handle of one save: staged, finished,
  forgotten, aborted; the one loop that polls the daemon
- :mod:`~ckpt_client.transport.pool_copy` — copying buffers into the mapped pool
- :mod:`~ckpt_client.transport.cuda_routing` — per buffer: the daemon copies it from a CUDA
  IPC handle, or we copy it through shared memory
- :mod:`~ckpt_client.transport.cuda_exports` — the CUDA exports the daemon holds open and
  the IPC reference counters they owe

Not to be confused with the daemon's ``ckptd.staging`` (its pool and device copies).
"""
