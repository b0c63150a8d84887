"""The client endpoint over a real socket: typed bodies, error replies, deferred answers."""

from __future__ import annotations

import pytest
import zmq

from ckptd import protocol
from ckptd.protocol import Hello, Poll, PollReply, RequestState, StageReply
from ckptd.server.endpoint import DEFERRED, ClientEndpoint, RequestError


@pytest.fixture
def endpoint():
    context = zmq.Context()
    server = ClientEndpoint(context, "incarnation-1")
    server.bind("inproc://endpoint-test")
    client = protocol.Channel("inproc://endpoint-test", context)
    yield server, client
    client.close()
    server.close()
    context.term()


def ask(server, client, msg_type, body=None):
    msg_id = client.send(msg_type, body)
    assert server.socket.poll(5000)
    server.serve_one()
    return client.wait(msg_id, 5.0)


def test_a_handler_gets_a_checked_body_and_its_answer_goes_back(endpoint):
    server, client = endpoint
    server.route(Poll, lambda call, body: PollReply(
        requests={rid: RequestState(phase="done", bytes_total=rid) for rid in body.request_ids}))
    reply = ask(server, client, "poll", {"request_ids": [3]}).body
    assert PollReply.from_wire(reply).requests[3] == RequestState(phase="done", bytes_total=3)


def test_a_request_type_without_a_declared_reply_cannot_be_routed(endpoint):
    server, _ = endpoint
    with pytest.raises(KeyError, match="no reply body is declared for 'nonsense'"):
        server.route(Hello, lambda call, body: None, "nonsense")


@pytest.mark.parametrize("answer", [
    {"requests": {}},                                          # a hand-written map
    StageReply(request_id=1, offset=0, length=0, phase="staging"),  # another request's reply
])
def test_a_reply_of_the_wrong_type_is_never_sent_the_trainer_hears_of_the_bug(endpoint, answer):
    server, client = endpoint
    server.route(Poll, lambda call, body: answer)
    with pytest.raises(protocol.ErrorReply, match="where a PollReply is due") as info:
        ask(server, client, "poll", {})
    assert info.value.code == "internal"
    server.route(Poll, lambda call, body: PollReply(requests={}))
    assert ask(server, client, "poll", {}).body == {"requests": {}}  # still serving


@pytest.mark.parametrize("msg_type,body,code", [
    ("nonsense", {}, "unknown_type"),
    ("hello", {"rank": "zero", "pid": 10}, "bad_request"),
    ("hello", {"pid": 10}, "bad_request"),
])
def test_bad_requests_get_error_replies(endpoint, msg_type, body, code):
    server, client = endpoint
    server.route(Hello, lambda call, body: pytest.fail("a bad request reached the handler"))
    with pytest.raises(protocol.ErrorReply) as info:
        ask(server, client, msg_type, body)
    assert info.value.code == code


def test_refusals_and_bugs_become_errors_and_the_endpoint_keeps_serving(endpoint):
    server, client = endpoint

    def refuse(call, body):
        raise RequestError("path_refused", "outside the roots", "save under --root")

    server.route(Hello, refuse)
    server.route(Poll, lambda call, body: 1 / 0)
    with pytest.raises(protocol.ErrorReply) as info:
        ask(server, client, "hello", {"rank": 0, "pid": 1})
    assert info.value.code == "path_refused" and info.value.body["hint"] == "save under --root"
    with pytest.raises(protocol.ErrorReply) as info:
        ask(server, client, "poll", {})
    assert info.value.code == "internal" and "ZeroDivisionError" in str(info.value)


def test_a_deferred_call_is_answered_once_later(endpoint):
    server, client = endpoint
    held = []
    server.route(Poll, lambda call, body: held.append(call) or DEFERRED)
    msg_id = client.send("poll", {})
    assert server.socket.poll(5000)
    server.serve_one()
    with pytest.raises(protocol.ReplyTimeout):
        client.wait(msg_id, 0.2)
    held[0].reply(PollReply(requests={7: RequestState(phase="writing")}))
    held[0].fail("internal", "a second answer is ignored")
    assert PollReply.from_wire(client.wait(msg_id, 5.0).body).requests[7].phase == "writing"
    assert not client.socket.poll(200)


def test_a_request_for_another_incarnation_never_reaches_a_handler(endpoint):
    server, client = endpoint
    server.route(Poll, lambda call, body: pytest.fail("a stale request reached the handler"))
    with pytest.raises(protocol.ErrorReply, match="was restarted") as info:
        ask(server, client, "poll", {"request_ids": [1], "incarnation": "incarnation-0"})
    assert info.value.code == "daemon_restarted"
    server.route(Poll, lambda call, body: PollReply(requests={}))
    assert ask(server, client, "poll", {"incarnation": "incarnation-1"}).body == {"requests": {}}
