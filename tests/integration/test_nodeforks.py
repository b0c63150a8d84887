"""The bed's fork server never hands a fork another fork's rank.

A real fork server (``tests/nodeforks.py``: its own process, torch imported, ranks forked
from it) started on this host, as the bed nodes' ranks use it. The server is SIGSTOPped
while a first job is sent, so that fork gives up; once it resumes, its ``started`` line
comes late, after a second job was sent. Before, the second fork took that line for its
own and returned the first job's rank. Each rank blocks opening its job file (a FIFO
nobody writes), so its output (its own log) shows which job it runs.
"""

from __future__ import annotations

import os
import signal

import pytest

import nodeforks
from conftest import wait_for


def test_a_late_started_line_is_discarded_not_taken_for_the_next_fork(tmp_path, monkeypatch):
    server = nodeforks.NodeForkServer(nodeforks.HostPopen(), 0, str(tmp_path / "server.log"))
    ranks: list[int] = []
    try:
        jobs = {}
        for name in ("first", "second"):
            os.mkfifo(tmp_path / f"{name}.job")  # a rank opening it blocks: it stays
            jobs[name] = (str(tmp_path / f"{name}.job"), str(tmp_path / f"{name}.log"))
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            monkeypatch.setattr(nodeforks, "START_TIMEOUT", 0.5)
            with pytest.raises(RuntimeError, match="forked no rank"):
                server.fork(jobs["first"][0], "bednodes", {}, jobs["first"][1])
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        monkeypatch.setattr(nodeforks, "START_TIMEOUT", 120.0)
        pid = server.fork(jobs["second"][0], "bednodes", {}, jobs["second"][1])
        ranks.append(pid)
        output = wait_for(lambda: _log_of(pid), 60, "the rank to open its log")
        assert output == jobs["second"][1], "the second fork returned the first job's rank"
        late = wait_for(lambda: server.discarded, 60, "the first job's late rank")
        ranks += late
        assert late != [pid], late
        assert server.wait(late[0], 60) == -signal.SIGKILL, "the late rank must be killed"
    finally:
        for pid in ranks:
            if not server.exited(pid):
                os.kill(pid, signal.SIGKILL)
        server.close()


def _log_of(pid: int) -> str | None:
    """Where rank ``pid`` writes its output, once it opened its log (before: the server's
    pipe)."""
    target = os.readlink(f"/proc/{pid}/fd/1")
    return target if target.endswith(".log") else None
