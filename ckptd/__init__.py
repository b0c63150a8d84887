"""ckptd: the per-node checkpoint daemon.

The tree follows the execution boundaries (where each piece of code runs):

- ``server/``       the serve loop's thread: daemon wiring and life, the client endpoint
                    and its handler table, ranks, save requests and their lifecycle (the
                    only writer of a request's phase, and the extent lease), the save and
                    local-checkpoint services;
- ``staging/``      the staging pool (shared memory, back-pressure allocator) and the CUDA
                    stager thread (IPC handles, device-to-host copies);
- ``storage/``      writer processes and the one durable-write module, allowed roots, the
                    node-local checkpoint store;
- ``replication/``  the replicator thread and its bulk connection threads: peer control
                    (CURVE), heartbeats, part streams over sealed tcp, push / fetch / serve;

and, at the top, what several of them (or the client) share:

- ``protocol/`` the wire contract with ``ckpt_client``, one concern a module (names,
                errors, framing, typed bodies, extent layout, part header, shared rules,
                IPC counters, discovery, liveness, the request channel) behind a face
                that re-exports them (with ``checksum`` and ``knobs``, the only modules
                the client may import; each declares ``__all__``)
- ``checksum``  checksum records beside every file, and their verification
- ``knobs``     every tunable and its environment override, read at call time
- ``mailbox``   typed hand-over between the serve loop and worker threads
- ``metrics/``  Prometheus families, save statistics, textfile and loopback endpoint
- ``readiness`` ready line, ready file, sd_notify
- ``status``    the ``ckptd status`` client (must not import torch)
- ``cli``       the ``ckptd`` command
"""

__version__ = "0.1.0"
