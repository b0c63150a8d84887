"""The bulk path's control vocabulary over a real connected socket pair: each body the
sender builds arrives checked, under its own frame kind; a map that breaks the schema, or
a payload that is not a map, drops the connection instead of reaching a handler."""

from __future__ import annotations

import socket

import pytest

from ckptd.protocol import pack_value
from ckptd.replication.bulk_connection import BulkConnectionError, Kind
from ckptd.replication.bulk_wire import (CONTROL_BODIES, Abort, Begin, Done, End, Ready,
                                         control_body, send_control)
from peerclient import keyed_ends


@pytest.fixture
def ends():
    a, b = keyed_ends(*socket.socketpair())
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("body, kind", [
    (Begin("s", 1, 2), Kind.BEGIN), (Begin("s", 0, 0, crc=7), Kind.BEGIN),
    (Ready(True), Kind.READY), (Ready(False, "full"), Kind.READY), (End(10), Kind.END),
    (Done(True), Kind.DONE), (Done(False, "bad crc"), Kind.DONE), (Abort("gone"), Kind.ABORT),
])
def test_each_body_arrives_checked_under_its_kind(ends, body, kind):
    a, b = ends
    send_control(a, 42, body, extra=5)
    frame = b.receive()
    assert (frame.kind, frame.xfer, frame.extra) == (kind, 42, 5)
    assert control_body(frame) == body


def test_every_control_kind_has_one_body():
    assert set(CONTROL_BODIES) == set(Kind.CONTROL)
    assert len(set(CONTROL_BODIES.values())) == len(Kind.CONTROL)


@pytest.mark.parametrize("kind, payload", [
    (Kind.BEGIN, {"owner": 1, "iteration": 2}),               # no session
    (Kind.BEGIN, {"session": "s", "owner": -1, "iteration": 2}),
    (Kind.READY, {"error": "no ok"}),
    (Kind.DONE, {"ok": "yes"}),
    (Kind.END, {"size": -3}),
    (Kind.ABORT, {"error": 5}),
])
def test_a_map_that_breaks_its_schema_is_refused(ends, kind, payload):
    a, b = ends
    a.send(kind, 1, payload=payload)
    with pytest.raises(BulkConnectionError, match="refused a control frame"):
        control_body(b.receive())


def test_a_payload_that_is_not_a_map_is_refused(ends):
    a, b = ends
    a.send(Kind.DONE, 1, payload=pack_value([1, 2]))
    with pytest.raises(BulkConnectionError, match="must be a map"):
        control_body(b.receive())


def test_a_chunk_has_no_control_body(ends):
    a, b = ends
    a.send(Kind.CHUNK, 1, payload=b"bytes")
    with pytest.raises(BulkConnectionError, match="carries no body"):
        control_body(b.receive())
