"""Staging: where a save's bytes wait between the trainer and the writers.

- ``pool``  the shared-memory staging pool (allocated once, page-locked when a GPU is
            present) and its extent allocator with FIFO back-pressure;
- ``segment`` the pool's file: created in the pool directory, bound to NUMA nodes, its
            pages (huge where the mount allows) reserved and mapped;
- ``pool_directory`` whether a directory may hold a pool (tmpfs or hugetlbfs) and how
            much of a mapping the kernel maps with huge pages;
- ``numa``  which NUMA node a GPU or a rank is on, and binding memory to it;
- ``cuda``  the daemon's CUDA side: opening trainers' IPC handles and copying
            device-to-host into the pool, one stager thread per device;
- ``exports`` which trainers' CUDA exports a stager holds open, and paying each
            export's IPC reference counter exactly once (pure, no torch).
- ``copy_views`` one part of a CUDA save as (pool, storage) view pairs, checked against
            the request and the storages' bounds, for one ``_foreach_copy_``.

Runs in the daemon process; the stager thread hands results to the serve loop through a
:class:`ckptd.mailbox.Mailbox`. Knows nothing of requests' phases or files.
"""
