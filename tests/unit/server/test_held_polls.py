"""Held POLLs over a real socket: parked while nothing moved, answered once, by the first
of a phase change (after the round), the bound, a goodbye or the daemon's stop.

The requests are moved by the real :class:`SaveLifecycle` (a real shared-memory pool), so
the phase changes that wake the polls come from the one place phases are set.
"""

from __future__ import annotations

import time

import pytest
import zmq

from ckptd import knobs, protocol
from ckptd.protocol import HelloReply, Phase, Poll, PollReply, ProtocolError
from ckptd.server.endpoint import ClientEndpoint
from ckptd.server.held_polls import PollAnswers
from ckptd.server.lifecycle import CLIENT_COPY, SaveLifecycle
from ckptd.server.requests import RequestTable
from test_lifecycle import Effects, make, pool  # noqa: F401 (fixture)


class Daemonish:
    """The endpoint, the table, the lifecycle and the poll handler, wired as the daemon
    wires them (phase changes reach the held polls through the effects)."""

    def __init__(self, pool, context) -> None:
        self.table = RequestTable()
        self.polls = PollAnswers(self.table)
        effects = Effects()
        effects.phase_changed = lambda request: self.polls.held.changed(request.id)
        self.life = SaveLifecycle(pool, self.table, effects)
        self.endpoint = ClientEndpoint(context, "incarnation-1")
        self.endpoint.route(Poll, self.polls.on_poll)
        self.endpoint.bind("inproc://held-polls")

    def request(self, routing_id: bytes):
        request = make(self.table)
        request.routing_id = routing_id
        assert self.life.admit(request) and request.phase == Phase.STAGING
        return request

    def serve(self, client, body: Poll) -> int:
        """Send ``body`` from ``client`` and let the daemon read it; returns its id."""
        msg_id = client.send("poll", body.to_wire())
        assert self.endpoint.socket.poll(5000)
        self.endpoint.serve_one()
        return msg_id


@pytest.fixture
def daemon(pool):  # noqa: F811
    context = zmq.Context()
    served = Daemonish(pool, context)
    clients = []

    def client():
        channel = protocol.Channel("inproc://held-polls", context)
        channel.socket.setsockopt(zmq.ROUTING_ID, b"c%d" % len(clients))
        channel.socket.disconnect("inproc://held-polls")
        channel.socket.connect("inproc://held-polls")
        clients.append(channel)
        return channel

    served.client = client
    yield served
    for channel in clients:
        channel.close()
    served.endpoint.close()
    context.term()


def answer(client, msg_id: int, request_id: int) -> str:
    return PollReply.from_wire(client.wait(msg_id, 5.0).body).requests[request_id].phase


def held(request_id: int, seen: str, wait: float = 30.0) -> Poll:
    return Poll(request_ids=[request_id], wait_seconds=wait, seen={request_id: seen})


def test_a_poll_with_news_or_without_a_wait_is_answered_at_once(daemon):
    client = daemon.client()
    request = daemon.request(b"c0")
    rid = request.id
    for body in (Poll(request_ids=[rid]),                       # an older client: no wait
                 held(rid, Phase.WAITING_FOR_POOL),             # it moved on since
                 Poll(request_ids=[rid], wait_seconds=30.0)):   # nothing seen yet
        assert answer(client, daemon.serve(client, body), rid) == Phase.STAGING
    assert answer(client, daemon.serve(client, held(rid + 1, Phase.STAGING)), rid + 1) \
        == "unknown"
    other = daemon.client()  # another connection's request is never its own
    assert answer(other, daemon.serve(other, held(rid, Phase.STAGING)), rid) == "unknown"
    with knobs.override(POLL_HOLD_MAX=0.0):  # the daemon's cap: it holds nothing
        assert answer(client, daemon.serve(client, held(rid, Phase.STAGING)), rid) \
            == Phase.STAGING
    daemon.life.abort(request, "the test is over")
    assert answer(client, daemon.serve(client, held(rid, Phase.ABORTED)), rid) == Phase.ABORTED
    assert len(daemon.polls.held) == 0


def test_a_held_poll_is_answered_once_after_the_round_its_request_moved_on(daemon):
    client = daemon.client()
    first, second = daemon.request(b"c0"), daemon.request(b"c0")
    msg_id = daemon.serve(client, Poll(request_ids=[first.id, second.id], wait_seconds=30.0,
                                       seen={first.id: Phase.STAGING,
                                             second.id: Phase.STAGING}))
    assert len(daemon.polls.held) == 1
    daemon.life.copied(first, CLIENT_COPY)  # staging -> writing: a step under way
    daemon.life.abort(second, "dropped")
    assert len(daemon.polls.held) == 1, "answered in the middle of a step"
    daemon.polls.held.answer_changed()  # the serve loop's round is over
    reply = PollReply.from_wire(client.wait(msg_id, 5.0).body)
    assert reply.requests[first.id].phase == Phase.WRITING
    assert reply.requests[second.id].phase == Phase.ABORTED
    assert len(daemon.polls.held) == 0
    daemon.life.job_done(first, "/ckpt/x/f0", True, {"path": "/ckpt/x/f0"}, 10)
    daemon.polls.held.answer_changed()  # nothing held on it any more: nothing sent
    assert client.socket.poll(0) == 0


def test_a_held_poll_ends_at_its_bound_with_the_phase_unchanged(daemon):
    client = daemon.client()
    request = daemon.request(b"c0")
    assert daemon.polls.held.next_due() is None  # the serve loop waits for nothing
    asked = time.monotonic()
    short = daemon.serve(client, held(request.id, Phase.STAGING, wait=1.0))
    long = daemon.serve(client, held(request.id, Phase.STAGING, wait=3600.0))
    due = daemon.polls.held.next_due()  # the serve loop wakes then: the short one's bound
    assert asked + 1.0 <= due <= time.monotonic() + 1.0
    daemon.polls.held.expire(time.monotonic() + 2.0)  # past the short one's bound only
    assert answer(client, short, request.id) == Phase.STAGING
    assert len(daemon.polls.held) == 1 and daemon.polls.held.next_due() > due + 10  # the long one (capped)
    with knobs.override(POLL_HOLD_MAX=5.0):  # capped by the daemon, whatever it asks
        capped = daemon.serve(client, held(request.id, Phase.STAGING, wait=3600.0))
    daemon.polls.held.expire(time.monotonic() + 6.0)
    assert answer(client, capped, request.id) == Phase.STAGING
    daemon.polls.held.close()  # the daemon stops: the last one is answered too
    assert answer(client, long, request.id) == Phase.STAGING
    assert len(daemon.polls.held) == 0


def test_a_goodbye_answers_its_connections_polls_and_a_gone_trainer_drops_them(daemon):
    leaving, gone, staying = daemon.client(), daemon.client(), daemon.client()
    requests = [daemon.request(b"c%d" % n) for n in range(3)]
    ids = [daemon.serve(c, held(r.id, Phase.STAGING)) for c, r in zip(
        (leaving, gone, staying), requests)]
    daemon.polls.held.release_connection(b"c0")
    assert answer(leaving, ids[0], requests[0].id) == Phase.STAGING
    daemon.polls.held.drop_connection(b"c1")
    assert len(daemon.polls.held) == 1
    daemon.polls.held.close()
    assert answer(staying, ids[2], requests[2].id) == Phase.STAGING
    assert gone.socket.poll(0) == 0, "a poll of a trainer that is gone was answered"


def test_the_poll_body_bounds_its_wait_and_names_only_its_requests():
    assert Poll.from_wire({"request_ids": [1]}) == Poll(request_ids=[1])
    assert Poll.from_wire({"request_ids": [1]}).wait_seconds == 0
    for bad in (-1, float("nan"), 3601, "5"):
        with pytest.raises(ProtocolError, match="wait_seconds"):
            Poll.from_wire({"request_ids": [1], "wait_seconds": bad})
    with pytest.raises(ProtocolError, match=r"'seen' names request\(s\) \[2\]"):
        Poll.from_wire({"request_ids": [1], "wait_seconds": 1, "seen": {2: "writing"}})
    hello = {"daemon_pid": 1, "incarnation": "x", "version": "0", "pool_path": "/p",
             "pool_size": 1}
    assert HelloReply.from_wire(hello).poll_hold_s == 0.0  # an older daemon holds nothing
