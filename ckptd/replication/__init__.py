"""Replication: a daemon's conversation with the daemons of other nodes.

Runs on the replicator thread (started by the serve loop when ``--peer-listen`` is given):

- ``transport``   the peer sockets: CURVE keys, the ZAP authenticator that admits only this
                  job's daemons, one link per peer, non-blocking senders;
- ``health``      each peer's heartbeat with a miss budget;
- ``wire``        the peer channel's typed vocabulary (part streams, heartbeats);
- ``streams``     one part stream per direction, with flow control;
- ``outgoing``    pushes to holders, and parts served to fetchers (verified first);
- ``incoming``    replicas received, and fetches that try the holders in order;
- ``commands``    the mailbox vocabulary between the serve loop and this thread;
- ``replicator``  the thread, its loop and handler tables, and the status snapshot.

It must not touch requests, the ledger or the pool allocator: it reads the extents it is
told to push and writes parts through ``ckptd.storage.local_store``.
"""
