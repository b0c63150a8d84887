"""The request channel from several threads at once: each thread gets its own reply."""

import threading

import zmq

from ckptd import protocol


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
    stop.set()
    responder.join(5)
    channel.close()
    server.close(linger=0)
    context.term()
    assert not errors
    assert results == {(n, k): n * 100 + k for n in range(4) for k in range(20)}
