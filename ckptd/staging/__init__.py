"""Staging: where a save's bytes wait between the trainer and the writers.

- ``pool``  the shared-memory staging pool (allocated once, page-locked when a GPU is
            present) and its extent allocator with FIFO back-pressure;
- ``cuda``  the daemon's CUDA side: opening trainers' IPC handles and copying
            device-to-host into the pool on a stager thread.

Runs in the daemon process; the stager thread hands results to the serve loop through a
:class:`ckptd.mailbox.Mailbox`. Knows nothing of requests' phases or files.
"""
