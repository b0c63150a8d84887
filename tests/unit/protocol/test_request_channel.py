"""The request channel: replies matched to requests from several threads at once, error
replies, timeouts, and giving up early."""

import os
import signal
import sys
import threading

import pytest
import zmq

from conftest import wait_for
from ckptd import protocol


def shut_down(stop, responder, channel, server, context) -> None:
    """Stop a test's responder thread, then close both ends and their context."""
    stop.set()
    responder.join(5)
    channel.close()
    server.close(linger=0)
    context.term()


def test_threads_sharing_a_channel_each_get_their_own_reply():
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://channel-threads")
    channel = protocol.Channel("inproc://channel-threads", context)
    stop = threading.Event()

    def echo():  # answers in reverse order of arrival, to mix the replies up
        pending = []
        while not stop.is_set():
            if server.poll(20):
                routing_id, *frames = server.recv_multipart()
                pending.append((routing_id, protocol.decode(frames)))
            elif pending:
                for routing_id, msg in reversed(pending):
                    server.send_multipart([routing_id, *protocol.encode(
                        "reply", msg.id, {"echo": msg.body["n"]})])
                pending.clear()

    responder = threading.Thread(target=echo, daemon=True)
    responder.start()
    results, errors = {}, []

    def ask(n):
        try:
            for k in range(20):
                results[(n, k)] = channel.call("ping", {"n": n * 100 + k}, timeout=10).body["echo"]
        except Exception as exc:
            errors.append(exc)

    askers = [threading.Thread(target=ask, args=(n,)) for n in range(4)]
    for thread in askers:
        thread.start()
    for thread in askers:
        thread.join(60)
    shut_down(stop, responder, channel, server, context)
    assert not errors
    assert results == {(n, k): n * 100 + k for n in range(4) for k in range(20)}


def test_an_error_reply_raises_with_its_body_and_silence_times_out():
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://channel-errors")
    channel = protocol.Channel("inproc://channel-errors", context)
    try:
        msg_id = channel.send("stage", {"n": 1})
        assert server.poll(10_000)
        routing_id, *frames = server.recv_multipart()
        assert protocol.decode(frames).id == msg_id
        server.send_multipart([routing_id, *protocol.encode(
            protocol.MessageType.ERROR, msg_id,
            protocol.error_body("bad_request", "stage: 'path' is missing", "send a path", rank=3))])
        with pytest.raises(protocol.ErrorReply, match="'path' is missing") as info:
            channel.wait(msg_id, timeout=10)
        assert info.value.code == "bad_request" and info.value.body["rank"] == 3
        with pytest.raises(protocol.ReplyTimeout, match="no reply from inproc://channel-errors"):
            channel.call("ping", timeout=0.2)  # the server never answers this one

        class DaemonGone(Exception):
            pass

        def give_up():
            raise DaemonGone()

        with pytest.raises(DaemonGone):
            channel.call("ping", timeout=60, still_worth_waiting=give_up)
    finally:
        channel.close()
        server.close(linger=0)
        context.term()


def test_a_late_reply_nobody_waits_for_is_still_reported_when_collected():
    """A reply to a request whose wait ran out is dropped, but ``on_reply`` hears of it
    (the peer answers again), when a wait reads it or when ``collect`` does; a reply some
    thread still waits for is kept for it."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://channel-late")
    channel = protocol.Channel("inproc://channel-late", context)
    heard = []
    channel.on_reply = heard.append
    try:
        gave_up = channel.send("poll", {})
        with pytest.raises(protocol.ReplyTimeout):
            channel.wait(gave_up, timeout=0.1)
        kept = channel.send("ping", {})
        for _ in range(2):
            assert server.poll(10_000)
            routing_id, *frames = server.recv_multipart()
            server.send_multipart([routing_id, *protocol.encode(
                "reply", protocol.decode(frames).id, {})])
        wait_for(lambda: channel.collect() or len(heard) == 2, 10, "both replies read")
        assert heard == [gave_up, kept]
        assert channel.wait(kept, timeout=1).id == kept  # kept for its waiter
        assert heard == [gave_up, kept], "a kept reply is reported once"
    finally:
        channel.close()
        server.close(linger=0)
        context.term()


def test_the_socket_is_lent_in_the_order_threads_asked_for_it():
    """A thread that gives its turn back and asks again at once (a waiter between two
    slices of a long wait) queues behind the threads already waiting: a plain lock would
    hand it straight back and keep the others waiting for as long as its wait lasts."""
    turns = protocol.Turns()
    order = []

    def take(name):
        with turns:
            order.append(name)

    turns.__enter__()  # this thread is at the socket
    others = []
    for name in ("b", "c"):
        others.append(threading.Thread(target=take, args=(name,)))
        others[-1].start()
        wait_for(lambda: turns.waiting == len(others), 10, f"{name} queued for its turn")
    turns.__exit__(None, None, None)
    take("a, asking again")
    for thread in others:
        thread.join(10)
    assert order == ["b", "c", "a, asking again"]


def test_a_signal_handlers_call_that_needs_another_threads_request_is_answered():
    """The main thread waits on a reply the peer holds (a held POLL) when a real signal's
    handler calls through the channel, and the peer answers that call only once another
    thread's request arrived (a background stager's STAGED): the handler lends its
    thread's turn between slices, so the other thread's request goes out and every call
    is answered. Holding the turn for the whole handler, the other thread's request and
    so the handler's reply waited for a call timeout."""
    context = zmq.Context()
    server = context.socket(zmq.ROUTER)
    server.bind("inproc://channel-lent-turn")
    channel = protocol.Channel("inproc://channel-lent-turn", context)
    got_b, stop = threading.Event(), threading.Event()

    def peer():  # answers c at once, b once c was answered, and a once b was
        held, answered = {}, set()
        while not stop.is_set():
            if not server.poll(20):
                continue
            routing_id, *frames = server.recv_multipart()
            msg = protocol.decode(frames)
            held[msg.type] = (routing_id, msg.id)
            if msg.type == "b":
                got_b.set()
            for kind, after in (("c", None), ("b", "c"), ("a", "b")):
                if kind in held and (after is None or after in answered):
                    routing, msg_id = held.pop(kind)
                    server.send_multipart([routing, *protocol.encode("reply", msg_id,
                                                                     {"k": kind})])
                    answered.add(kind)

    seen, errors = {}, []

    def handler(signum, frame):
        seen["b"] = channel.call("b", timeout=10).body["k"]

    def other_thread():
        try:
            wait_for(lambda: main_waits(), 10, "the main thread waiting for a's reply")
            os.kill(os.getpid(), signal.SIGUSR1)
            assert got_b.wait(10), "the handler's request never arrived"
            seen["c"] = channel.call("c", timeout=10).body["k"]
        except BaseException as exc:  # the test reads it
            errors.append(exc)

    main = threading.main_thread()

    def main_waits():
        frame = sys._current_frames().get(main.ident)
        while frame is not None and frame.f_code.co_name != "_receive":
            frame = frame.f_back
        return frame is not None

    responder = threading.Thread(target=peer, daemon=True)
    responder.start()
    previous = signal.signal(signal.SIGUSR1, handler)
    helper = threading.Thread(target=other_thread, daemon=True)
    try:
        helper.start()
        seen["a"] = channel.call("a", timeout=30).body["k"]
    finally:
        signal.signal(signal.SIGUSR1, previous)
        helper.join(30)
        shut_down(stop, responder, channel, server, context)
    assert not errors
    assert seen == {"a": "a", "b": "b", "c": "c"}
