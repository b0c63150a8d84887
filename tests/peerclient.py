"""A stand-in for another job's daemon (or a stranger): real peer wire, chosen keys.

Tests use it to knock on a real daemon's doors: the ZeroMQ control socket (CURVE) and
the bulk listener (:mod:`ckptd.replication.bulk_connection`), each with a key pair the test
chooses, so they can show what a key the trainers never named gets (nothing) and what a
named one gets (answers).
"""

from __future__ import annotations

import os

import zmq
from zmq.utils import z85

from ckptd import protocol
from ckptd.protocol import MessageType
from ckptd.replication.bulk_connection import BulkConnection, BulkConnectionError, Kind
from ckptd.replication.bulk_wire import Begin, Ready, control_body, send_control


def keypair() -> tuple[str, str]:
    """A fresh CURVE key pair (z85 public, z85 secret)."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def keyed_ends(left, right, protection: str = "aes-256-gcm") -> tuple:
    """Two :class:`BulkConnection` s over a connected socket pair, sharing fresh direction
    keys without a handshake (for tests of the frames themselves)."""
    one, two = os.urandom(32), os.urandom(32)
    return (BulkConnection(left, one, two, protection, b"b" * 32),
            BulkConnection(right, two, one, protection, b"a" * 32))


def register_session(socket_path: str, session: str, root: str, extra_peers=()) -> dict:
    """Talk to a daemon as its only rank: hello, peer info, and a session whose table names
    the daemon itself plus ``extra_peers`` ([address, public key, bulk address] each).
    Returns the daemon's peer info."""
    channel = protocol.Channel(protocol.endpoint_for(socket_path))
    try:
        channel.call(MessageType.HELLO, {"rank": 0, "pid": os.getpid(), "world_size": 1})
        info = channel.call(MessageType.PEER_INFO).body
        peers = [[info["address"], info["public_key"], info["bulk_address"]], *map(list, extra_peers)]
        channel.call(MessageType.LOCAL_SESSION, {"session": session, "root": root,
                                                 "world_size": len(peers), "peers": peers,
                                                 "cliques": []})
    finally:
        channel.close()
    return info


def dial_bulk(info: dict, public: str, secret: str, protection: str | None = None,
              timeout: float = 30.0) -> BulkConnection:
    """Open a bulk connection to the daemon of ``info`` with this key pair.

    Raises
    ------
    BulkConnectionError
        If the daemon refuses (it answers an unknown key with nothing at all).
    """
    host, _, port = info["bulk_address"].rpartition(":")
    return BulkConnection.dial((host, int(port)), z85.decode(secret.encode()),
                        z85.decode(public.encode()), z85.decode(info["public_key"].encode()),
                        protection or info["encryption"], timeout, timeout)


def push_begin(channel: BulkConnection, xfer: int, session: str, owner: int, iteration: int,
               size: int) -> Ready:
    """Announce a replica push on a bulk connection; returns the daemon's READY answer."""
    send_control(channel, xfer, Begin(session, owner, iteration), extra=size)
    frame = channel.receive()
    assert frame.kind == Kind.READY, frame.kind
    return control_body(frame)


def bulk_refused(info: dict, public: str, secret: str) -> str | None:
    """The reason a bulk connection with this key pair fails, or None if it was accepted."""
    try:
        dial_bulk(info, public, secret, timeout=10.0).close()
    except BulkConnectionError as exc:
        return str(exc)
    return None
