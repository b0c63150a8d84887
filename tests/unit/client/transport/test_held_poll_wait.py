"""A held POLL's reply is due at the end of the hold: the trainer waits a whole call
timeout beyond it before it calls the daemon silent.

The real :class:`DaemonConnection` and :func:`ask_phase`; the channel is a stand-in whose
daemon answers nothing (this process's pid stands for a daemon alive but silent), so the
give-up message says how long the trainer waited.
"""

from __future__ import annotations

import os

import pytest

from ckptd import knobs, protocol
from ckptd.protocol import Phase
from ckpt_client.errors import DaemonNotAnsweringError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.transport.phase_poll import ask_phase, poll_hold
from test_connection_hooks import QuietChannel


def silent_daemon(poll_hold_s: float) -> DaemonConnection:
    hello = protocol.HelloReply(daemon_pid=os.getpid(), incarnation="test", version="test",
                                pool_path="/nonexistent", pool_size=0, poll_hold_s=poll_hold_s)
    return DaemonConnection("/nonexistent/ckptd.sock", QuietChannel(), hello, rank=0)


def test_a_held_poll_is_called_unanswered_only_a_call_timeout_after_its_hold():
    connection = silent_daemon(poll_hold_s=30)
    with knobs.override(CALL_TIMEOUT=0.5, POLL_HOLD=5):
        hold = poll_hold(connection)
        with pytest.raises(DaemonNotAnsweringError) as caught:
            ask_phase(connection, 7, Phase.STAGING, hold=True)
    assert hold == 0.25
    assert f"within {waits.as_text(0.5 + hold)}. " in str(caught.value), caught.value
    assert connection.not_answering is not None  # a whole call timeout passed: marked


def test_a_poll_that_is_not_held_waits_one_call_timeout():
    connection = silent_daemon(poll_hold_s=30)
    with knobs.override(CALL_TIMEOUT=0.5):
        with pytest.raises(DaemonNotAnsweringError) as caught:
            ask_phase(connection, 7, Phase.STAGING, hold=False)
    assert "within 0.5s. " in str(caught.value), caught.value
