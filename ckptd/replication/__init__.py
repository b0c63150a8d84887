"""Replication: a daemon's conversation with the daemons of other nodes.

Runs on the replicator thread (started by the serve loop when ``--peer-listen`` is given)
and, for part bytes, on the bulk connection threads it starts:

- ``transport``   the peer control sockets: CURVE keys, the ZAP authenticator that admits
                  only this job's daemons, one link per peer, non-blocking senders, and
                  the address this daemon advertises (never loopback for 0.0.0.0);
- ``health``      each peer's heartbeat with a miss budget (control link only);
- ``wire``        the control channel's typed vocabulary (heartbeats, fetch requests),
                  built by the sender and checked on arrival;
- ``sealing``     the bulk path's keys (X25519 of the CURVE keys, HKDF per connection)
                  and per-frame protection (AES-256-GCM, or GMAC only);
- ``bulk_connection`` one bulk tcp connection: its handshake and sealed frames;
- ``bulk_wire``   the bulk path's typed vocabulary (the control frames' bodies);
- ``streams``     where a part's bytes come from (the staging pool, or a file);
- ``bulk_send``   parts sent over several connections per peer, resumed after a break;
- ``refusals``    when refused dials mean the peer daemon is gone (not a passing reject);
- ``bulk_receive`` the bulk listener, and parts written and checksummed as they arrive;
- ``outgoing``    pushes to holders, and parts served to fetchers (checked as they go);
- ``incoming``    replicas received, and fetches that try the holders in order;
- ``commands``    the mailbox vocabulary between the serve loop, this thread and the
                  bulk threads;
- ``replicator``  the thread, its loop and handler tables, and the status snapshot.

It must not touch requests, the ledger or the pool allocator: it reads the extents it is
told to push and writes parts through ``ckptd.storage.local_store``.
"""
