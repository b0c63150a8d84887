"""The connection's "not answering" mark (ckpt_client.transport.silence.AnswerWatch), in the
orders two threads of one trainer can feed it."""

from __future__ import annotations

from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.transport.silence import AnswerWatch


def unanswered(msg_id: int) -> DaemonUnavailableError:
    return DaemonUnavailableError("/run/ckptd.sock", f"request {msg_id} went unanswered")


def test_a_reply_read_by_another_thread_before_the_timeout_is_reported_marks_nothing():
    # Thread A's wait for request 10 ends empty; before it reports that, thread B (holding
    # the channel's lock) reads request 10's reply after all. The daemon answered: no mark.
    watch = AnswerWatch("rank 0")
    watch.heard(10)
    watch.went_silent(10, "poll", 30.0, unanswered(10))
    assert watch.mark is None


def test_an_unanswered_request_marks_and_its_late_reply_clears():
    watch = AnswerWatch("rank 0")
    watch.heard(9)
    watch.went_silent(10, "poll", 30.0, unanswered(10))
    assert watch.mark is not None and watch.mark.msg_id == 10
    watch.heard(9)  # older than the mark: says nothing about now
    assert watch.mark is not None
    watch.heard(10)
    assert watch.mark is None
