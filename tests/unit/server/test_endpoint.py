"""The client endpoint over a real socket: typed bodies, error replies, deferred answers."""

from __future__ import annotations

import pytest
import zmq

from ckptd import protocol
from ckptd.protocol import Hello, Poll
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
    server.route(Hello, lambda call, body: {"rank": body.rank, "size": body.world_size})
    assert ask(server, client, "hello", {"rank": 3, "pid": 10}).body == {"rank": 3, "size": 1}


@pytest.mark.parametrize("msg_type,body,code", [
    ("nonsense", {}, "unknown_type"),
    ("hello", {"rank": "zero", "pid": 10}, "bad_request"),
    ("hello", {"pid": 10}, "bad_request"),
])
def test_bad_requests_get_error_replies(endpoint, msg_type, body, code):
    server, client = endpoint
    server.route(Hello, lambda call, body: {})
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
    held[0].reply({"late": True})
    held[0].fail("internal", "a second answer is ignored")
    assert client.wait(msg_id, 5.0).body == {"late": True}
    assert not client.socket.poll(200)


def test_a_request_for_another_incarnation_never_reaches_a_handler(endpoint):
    server, client = endpoint
    server.route(Poll, lambda call, body: pytest.fail("a stale request reached the handler"))
    with pytest.raises(protocol.ErrorReply, match="was restarted") as info:
        ask(server, client, "poll", {"request_ids": [1], "incarnation": "incarnation-0"})
    assert info.value.code == "daemon_restarted"
    server.route(Poll, lambda call, body: {"requests": {}})
    assert ask(server, client, "poll", {"incarnation": "incarnation-1"}).body == {"requests": {}}
