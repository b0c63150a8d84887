"""The mailbox between threads: items arrive in order, and the doorbell wakes a poller."""

import threading

import zmq

from ckptd.mailbox import Mailbox


def test_items_from_another_thread_wake_the_poller_and_arrive_in_order():
    context = zmq.Context()
    try:
        box = Mailbox(context, "test")
        poller = zmq.Poller()
        poller.register(box.doorbell, zmq.POLLIN)
        sender = threading.Thread(target=lambda: [box.post(i) for i in range(5000)])
        sender.start()
        received: list = []
        while len(received) < 5000:
            assert poller.poll(10_000), "the doorbell did not ring"
            box.drain(received.append)
        sender.join()
        assert received == list(range(5000))
        box.drain(received.append)  # a ring may outlive the item it announced
        assert len(received) == 5000 and not poller.poll(0)
        box.close()
    finally:
        context.term()
