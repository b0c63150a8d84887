"""A give-up message says the wait that ran out as it was waited, not rounded to seconds.

A 1.5 s call timeout read "within 2s": a reader then looks for a 2 s setting that nobody
made. The real :class:`DaemonConnection` raises the message; its channel is a stand-in
whose daemon answers nothing (this process's pid stands for a daemon alive but silent).
"""

from __future__ import annotations

import os

import pytest

from ckptd import protocol
from ckpt_client.errors import DaemonNotAnsweringError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection
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
