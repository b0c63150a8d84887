"""A chunk's body over real tcp on 127.0.0.1 with blocking sockets, as the daemons use
them: the receiving end waits for slices of a body, not for each segment, yet a body whose
last bytes are held back still arrives (a wait that brings nothing falls back to taking
bytes as they come), the body's tail wakes the receiver however its bytes are split, and
afterwards the connection wakes for any byte and waits without a limit again, so the small
frame that follows arrives."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import termios
import threading

import pytest

from ckptd import knobs
from ckptd.replication.bulk_connection import _HEADER, BulkConnection, Kind, _recv_exact
from ckptd.replication.sealing import TAG_BYTES
from conftest import wait_for
from peerclient import keyed_ends

TIMEOUT = 30.0
RECEIVE_SLICE_BYTES = knobs.PEER_RECEIVE_SLICE_BYTES.get()


@pytest.fixture
def tcp_ends():
    server = socket.create_server(("127.0.0.1", 0))
    left = socket.create_connection(server.getsockname())
    right, _ = server.accept()
    server.close()
    a, b = keyed_ends(left, right)
    yield a, b
    a.close()
    b.close()


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


def queued(sock: socket.socket) -> int:
    """Bytes received by the kernel and not yet read."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.FIONREAD, b"\0" * 4))[0]


def wait_limit(sock: socket.socket) -> tuple[int, int]:
    return struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))


def receive_in_thread(channel: BulkConnection) -> tuple[threading.Thread, dict]:
    """``channel.receive()`` on a thread (a receive that never returns fails the test by
    its join timeout instead of hanging it)."""
    out: dict = {}

    def run():
        try:
            frame = channel.receive()
            out["frame"] = (frame.kind, frame.xfer, frame.offset, bytes(frame.payload))
        except Exception as exc:  # reported by the test
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_body_whose_last_bytes_are_held_back_arrives_and_the_socket_is_reset(tcp_ends):
    a, b = tcp_ends
    payload = os.urandom(2 * RECEIVE_SLICE_BYTES + 1000)
    header = _HEADER.pack(Kind.CHUNK, 0, 0, len(payload), 7, 4096, 0)
    scratch = memoryview(bytearray(len(payload) + TAG_BYTES))
    wire = b"".join(bytes(buffer) for buffer in a._out.seal(header, payload, scratch))
    withheld = 100

    reader, out = receive_in_thread(b)
    a.sock.sendall(wire[:-withheld])
    # it read all that came, and nothing more comes within its wait: it takes bytes as
    # they come, without a limit
    wait_for(lambda: queued(b.sock) == 0 and lowat(b.sock) == 1
             and wait_limit(b.sock) == (0, 0), TIMEOUT, "the receiver to fall back to any byte")
    assert reader.is_alive() and not out
    a.sock.sendall(wire[-withheld:])
    reader.join(TIMEOUT)
    assert not reader.is_alive(), "the body's last bytes never woke the receiver"
    assert out == {"frame": (Kind.CHUNK, 7, 4096, payload)}
    assert (lowat(b.sock), wait_limit(b.sock)) == (1, (0, 0))

    reader, out = receive_in_thread(b)
    a.send(Kind.ACK, 7, offset=4096)  # 32 bytes of header and a 16-byte tag
    reader.join(TIMEOUT)
    assert not reader.is_alive(), "a small frame after a body never woke the receiver"
    assert out == {"frame": (Kind.ACK, 7, 4096, b"")}


def test_a_whole_body_sent_at_once_leaves_the_socket_as_it_was(tcp_ends):
    a, b = tcp_ends
    payload = os.urandom(3 * RECEIVE_SLICE_BYTES + 5)
    a.send(Kind.CHUNK, 9, offset=0, payload=payload)
    a.send(Kind.ACK, 9, offset=0)
    frame = b.receive()
    assert (frame.kind, frame.xfer, bytes(frame.payload)) == (Kind.CHUNK, 9, payload)
    assert (lowat(b.sock), wait_limit(b.sock)) == (1, (0, 0))
    assert b.receive().kind == Kind.ACK


class CountingSocket:
    """A real socket whose receives count the bytes they took, so that the test knows
    where in the body the receiving end is (nothing else is changed)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.got = sock, 0

    def recv_into(self, view) -> int:
        n = self.sock.recv_into(view)
        self.got += n
        return n

    def setsockopt(self, *args) -> None:
        self.sock.setsockopt(*args)


def test_the_tail_of_a_body_wakes_the_receiver_however_its_bytes_are_split(tcp_ends):
    """The kernel wakes a blocked reader for the bytes it has not copied yet: a receive
    that copied part of the body's tail and then waited for the whole tail's length would
    sleep until its wait limit (on a connection with nothing after the chunk, until the
    peer timeout without one). Here part of the tail is queued when a receive starts and
    the rest comes later; the wait limit is longer than the join, so such a sleep fails."""
    a, b = tcp_ends
    size = 2 * RECEIVE_SLICE_BYTES + 1000
    body = os.urandom(size)
    head, middle, last = body[:-600], body[-600:-300], body[-300:]
    view = memoryview(bytearray(size))
    counting = CountingSocket(b.sock)
    sent_middle = threading.Event()
    out: dict = {}

    def moved() -> None:  # between two receives: queue part of the tail for the next
        if counting.got == len(head) and not sent_middle.is_set():
            a.sock.sendall(middle)
            wait_for(lambda: queued(b.sock) >= len(middle), TIMEOUT, "the middle to arrive")
            sent_middle.set()

    def receive() -> None:
        try:
            _recv_exact(counting, view, moved, slices=True)
        except Exception as exc:  # reported by the test
            out["error"] = exc

    with knobs.override(PEER_RECEIVE_SLICE_WAIT=3 * TIMEOUT):
        reader = threading.Thread(target=receive, daemon=True)
        reader.start()
        a.sock.sendall(head)
        wait_for(lambda: sent_middle.is_set() and queued(b.sock) == 0, TIMEOUT,
                 "the receiver to read the middle of the tail")
        a.sock.sendall(last)
        reader.join(TIMEOUT)
    assert not reader.is_alive(), "the tail's last bytes did not wake the receiver"
    assert out == {} and bytes(view) == body
    assert (lowat(b.sock), wait_limit(b.sock)) == (1, (0, 0))
