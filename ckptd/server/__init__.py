"""The serve loop: the daemon process and everything that runs on its one thread.

- ``daemon``     composition root: start, readiness, housekeeping, drain and stop;
- ``process_messages`` the process-level messages (hello, goodbye, ping, status), the
                 status document, and the saves of trainers that are gone;
- ``config``     ``ckptd serve``'s options and their defaults;
- ``loop``       the reactor that polls every socket of the daemon;
- ``endpoint``   the client socket, its handler table, and the :class:`Call` handle that
                 answers each request exactly once (now or deferred);
- ``ranks``      the registered trainer processes and their liveness;
- ``requests``   save requests, replicas, history and the status document;
- ``lifecycle``  the only writer of a request's phase, and the extent lease whose named
                 holds decide when staged bytes may be reused;
- ``saves``      the save messages and the work each lifecycle step needs;
- ``local``      the local-checkpoint messages and the replication step of a save;
- ``resident``   the memory tier: finished local parts kept in the staging pool;
- ``redundancy`` where the durable copies of this node's latest local parts are;
- ``local_status`` the status document's local-checkpoint and replication sections.
"""
