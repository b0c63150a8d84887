"""A give-up message says the wait that ran out as it was waited, not rounded to seconds.

A 1.5 s call timeout read "within 2s": a reader then looks for a 2 s setting that nobody
made. The real :class:`DaemonConnection` raises the message; its channel is a stand-in
whose daemon answers nothing (this process's pid stands for a daemon alive but silent).
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from ckptd import knobs, protocol
from ckpt_client.errors import CheckpointException, DaemonNotAnsweringError, StagingTimeoutError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.daemon_save import DaemonSave
from ckpt_client.transport.background import BackgroundStager
from test_connection_hooks import QuietChannel


@pytest.mark.parametrize("waited, said", [(1.5, "1.5s"), (2.5, "2.5s"), (60.0, "60s"),
                                          (1.25, "1.25s"), (0.25, "0.25s"), (3.0001, "3s")])
def test_a_silent_daemon_is_said_to_have_missed_the_wait_that_was_waited(waited, said):
    hello = protocol.HelloReply(daemon_pid=os.getpid(), incarnation="test", version="test",
                                pool_path="/nonexistent", pool_size=0)
    connection = DaemonConnection("/nonexistent/ckptd.sock", QuietChannel(), hello, rank=0)
    with pytest.raises(DaemonNotAnsweringError) as caught:
        connection.call(protocol.MessageType.PING, timeout=waited)
    assert f"did not answer a ping request within {said}. " in str(caught.value), caught.value
    assert waits.as_text(waited) == said  # the words every give-up message uses


#: Knobs whose sum is a staging wait of 0.56 s: whole seconds would say "1s".
SHORT_WAITS = dict(STAGE_TIMEOUT=0.1, STAGING_DEADLINE=0.1, CALL_TIMEOUT=0.1, SERVE_TICK=0.01,
                   WAIT_MARGIN=0.0, SAVE_DEADLINE=0.1)


def quiet_connection() -> DaemonConnection:
    hello = protocol.HelloReply(daemon_pid=os.getpid(), incarnation="test", version="test",
                                pool_path="/nonexistent", pool_size=0)
    return DaemonConnection("/nonexistent/ckptd.sock", QuietChannel(), hello, rank=0)


def test_a_save_never_staged_says_the_staging_wait_as_it_was_waited():
    save = DaemonSave(quiet_connection(), request_id=1, path="/ckpt/a.pt")
    with knobs.override(**SHORT_WAITS):
        said = waits.as_text(waits.staging(None))
        with pytest.raises(CheckpointException) as caught:
            save.wait_staged()
    assert said == "0.56s"
    assert f"was not staged within {said}, longer" in str(caught.value), caught.value


def test_a_save_with_no_outcome_says_the_outcome_wait_as_it_was_waited():
    save = DaemonSave(quiet_connection(), request_id=1, path="/ckpt/a.pt")
    save.mark_staged()
    save.accepted_at = time.monotonic() - 3600
    with knobs.override(**SHORT_WAITS):
        said = waits.as_text(waits.save_outcome(None, tiered=False))
        state = save.poll()
    assert said == "0.22s"
    assert f"gave no outcome within {said} of accepting" in state.error, state.error


class Stuck:
    """A queued zero-stall save whose staging does not end until the test says so."""

    def __init__(self, save: DaemonSave) -> None:
        self.save = save
        self.release = threading.Event()

    def run(self) -> None:
        self.release.wait(60)


def test_saves_queued_too_long_say_the_staging_wait_as_it_was_waited():
    connection = quiet_connection()
    stager = BackgroundStager(connection)
    job = Stuck(DaemonSave(connection, request_id=None, path="/ckpt/a.pt"))
    stager.submit(job)
    try:
        with knobs.override(**SHORT_WAITS):
            said = waits.as_text(waits.background_staging(None, 1))
            with pytest.raises(StagingTimeoutError) as caught:
                stager.wait_idle()
    finally:
        job.release.set()
        stager.stop()
    assert f"were not staged within {said}, longer" in str(caught.value), caught.value
