"""Hostile bytes on every channel that decodes msgpack: an error reply (or a drop), never a
dead daemon.

The client socket is reachable by any process of the user; the peer port by any daemon
holding a key the trainers handed out (a compromised or buggy peer). Each test sends the
same family of payloads: tuple extensions, arrays and maps nested to many depths,
including the 4 KB tuple bomb that used to overflow the daemon's C stack; afterwards the
daemon must still be alive and serving saves.
"""

from __future__ import annotations

import os

import msgpack
import pytest
import torch
import zmq

from test_local_checkpoints import SESSION, make_nodes  # noqa: F401 (fixture)

from ckpt_client import AsyncCallsQueue, async_torch_save
from ckptd import protocol
from ckptd.replication.bulk_connection import BulkConnectionError, Kind
from ckptd.replication.bulk_wire import Ready, control_body
from ckptd.replication.wire import PeerPing, PeerPong

import peerclient

DEPTHS = (1, 16, 33, 100, 1000, 100_000)


def nested(kind: str, depth: int) -> bytes:
    """``depth`` levels of tuple extensions, arrays or maps around an empty list."""
    if kind == "array":
        return b"\x91" * depth + b"\x90"
    if kind == "map":
        return b"\x81\xa1k" * depth + b"\x90"
    inner = msgpack.packb([])
    for _ in range(depth):
        inner = msgpack.packb(msgpack.ExtType(2, inner))
    return inner


def hostile_messages() -> list:
    """(name, frames): every payload, as a bare header and inside a well-formed header."""
    cases = []
    for kind in ("ext", "array", "map"):
        for depth in DEPTHS:
            if kind == "ext" and depth > 1000:
                continue  # building 100k levels of ext in Python alone takes minutes
            payload = nested(kind, depth)
            cases.append((f"{kind}x{depth} header", [payload]))
            # a valid 3-entry header map, grown by one entry: "body": <payload>
            head = protocol.pack_value({"v": protocol.SCHEMA_VERSION, "type": "ping", "id": 9})
            grown = bytes([head[0] + 1]) + head[1:] + b"\xa4body" + payload
            cases.append((f"{kind}x{depth} in body", [grown]))
    return cases


def test_the_tuple_bomb_is_a_size_of_a_few_kilobytes():
    assert len(nested("ext", 1000)) < 5000  # the reproduction from the red-team report


def saves_still_work(socket_path: str, root: str, monkeypatch) -> None:
    monkeypatch.setenv("CKPTD_SOCKET", socket_path)
    path = os.path.join(root, "after-the-bombs.pt")
    queue = AsyncCallsQueue()
    queue.schedule_async_request(async_torch_save({"w": torch.arange(5.0)}, path))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.arange(5.0))


def test_hostile_client_messages_get_error_replies_and_the_daemon_lives(daemon, monkeypatch):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(protocol.endpoint_for(daemon.socket))
    try:
        for name, frames in hostile_messages():
            sock.send_multipart(frames)
            assert sock.poll(10_000), f"{name}: no reply (daemon alive: {daemon.process.poll()})"
            reply = protocol.decode(sock.recv_multipart())
            assert daemon.process.poll() is None, f"{name} killed the daemon"
            if name.startswith("ext") and int(name.split()[0][4:]) > protocol.MAX_TUPLE_NESTING:
                assert reply.type == "error" and reply.body["code"] == "malformed", name
    finally:
        sock.close()
    saves_still_work(daemon.socket, daemon.roots[0], monkeypatch)


def test_hostile_peer_messages_are_dropped_and_the_daemon_lives(make_nodes, tmp_path,
                                                                monkeypatch):
    nodes = make_nodes(1)
    daemon = nodes.daemons[0]
    channel = protocol.Channel(protocol.endpoint_for(daemon.socket))
    context = zmq.Context()
    try:
        channel.call("hello", {"rank": 0, "pid": os.getpid(), "world_size": 1})
        info = channel.call("peer_info").body
        peer_public, peer_secret = zmq.curve_keypair()
        channel.call("local_session", {
            "session": SESSION, "root": nodes.roots(1)[0], "world_size": 2,
            "peers": [[info["address"], info["public_key"]],
                      ["tcp://127.0.0.254:1", peer_public.decode()]], "cliques": []})
        peer = context.socket(zmq.DEALER)
        peer.linger = 0
        peer.curve_serverkey = info["public_key"].encode()
        peer.curve_publickey, peer.curve_secretkey = peer_public, peer_secret
        peer.connect(info["address"])
        for name, frames in hostile_messages():
            peer.send_multipart(frames)
        # The peer is still served: a heartbeat is answered.
        peer.send_multipart(protocol.encode(PeerPing.message_type, 0, PeerPing(1.0).to_wire()))
        assert peer.poll(30_000), "the daemon stopped answering its peer"
        reply = protocol.decode(peer.recv_multipart())
        assert reply.type == PeerPong.message_type and daemon.process.poll() is None
        assert "handling a message failed" in daemon.log()
    finally:
        channel.close()
        context.destroy(linger=0)
    saves_still_work(daemon.socket, daemon.roots[0], monkeypatch)


def test_hostile_bulk_frames_are_refused_and_the_daemon_lives(make_nodes, monkeypatch):
    nodes = make_nodes(1)
    daemon = nodes.daemons[0]
    public, secret = peerclient.keypair()  # a daemon the trainers named: it may connect
    info = peerclient.register_session(daemon.socket, SESSION, nodes.roots(1)[0],
                                       [["tcp://127.0.0.254:1", public, "127.0.0.254:1"]])
    for name, frames in hostile_messages()[::3]:
        channel = peerclient.dial_bulk(info, public, secret)
        try:  # sealed properly, but the BEGIN's payload is the hostile bytes, not a map
            channel.send(Kind.BEGIN, 1, extra=4, payload=frames[0])
            answer = channel.receive()
            # refused: a map that names no part
            assert answer.kind == Kind.READY and control_body(answer).ok is False, name
        except BulkConnectionError:
            pass  # hung up on: anything else (too large, not a map)
        finally:
            channel.close()
        assert daemon.process.poll() is None, f"{name} killed the daemon"
    # a well-formed stream on a new connection is still served
    channel = peerclient.dial_bulk(info, public, secret)
    try:
        assert peerclient.push_begin(channel, 2, SESSION, 1, 2, 4) == Ready(ok=True)
    finally:
        channel.close()
    saves_still_work(daemon.socket, daemon.roots[0], monkeypatch)


@pytest.mark.parametrize("kind", ["ext", "array", "map"])
def test_decoding_hostile_values_raises_instead_of_crashing(kind):
    """In a child process, so that a regression crashes the child, not the test run."""
    import subprocess
    import sys

    code = ("import sys; from ckptd import protocol\n"
            "data = sys.stdin.buffer.read()\n"
            "try:\n    protocol.unpack_value(data)\n    print('decoded')\n"
            "except Exception as exc:\n    print('refused', type(exc).__name__)\n")
    for depth in DEPTHS:
        if kind == "ext" and depth > 1000:
            continue
        run = subprocess.run([sys.executable, "-c", code], input=nested(kind, depth),
                             capture_output=True, timeout=120)
        assert run.returncode == 0, f"{kind}x{depth}: the decoder crashed ({run.returncode})"
        expected = "decoded" if depth <= protocol.MAX_TUPLE_NESTING or kind != "ext" else "refused"
        if kind != "ext" and depth > 1000:
            expected = "refused"  # msgpack's own nesting limit
        assert run.stdout.decode().startswith(expected), (kind, depth, run.stdout)
