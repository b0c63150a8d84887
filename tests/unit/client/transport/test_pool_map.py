"""A closed connection retires its mapping of the daemon's pool, never unmaps it.

The pool's views are torch tensors (``torch.frombuffer``: no buffer export), so unmapping
the pool at close would leave them pointing at nothing: the copier's cached destinations,
a copy still running on another thread. These tests save through a real daemon, close
the connection, then use the views the save left behind: they must read and write
harmlessly (in a child process, so that a regression is a failed test, not a crashed
run), and the daemon's pool file must no longer be mapped here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ckpt_client import TorchAsyncCheckpoint
from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.transport import handover
from ckpt_client.transport.connection import connect

USE_VIEWS_AFTER_CLOSE = r"""
import sys
import torch
from ckpt_client import TorchAsyncCheckpoint, connect
from ckpt_client.transport.handover import handover_for

connection = connect()
checkpoint = TorchAsyncCheckpoint()
checkpoint.async_save({"w": torch.full((1 << 16,), 3.0)}, sys.argv[1])
checkpoint.finalize_async_save(blocking=True)
views = [v for cached in handover_for(connection).copier._views.values() for v in cached]
views.append(connection.pool[-(1 << 20):])  # apart from the save's
assert any(bool((v == 3.0).all()) for v in views[:-1]), "the save's view holds no save"
connection.close()
with open("/proc/self/maps") as maps:
    assert connection.pool_path not in maps.read(), "the daemon's pool is still mapped"
assert not any(v.view(torch.uint8).any() for v in views), "a view reads the daemon's bytes"
for view in views:
    view.fill_(1)
    assert bool((view == 1).all())
torch._foreach_copy_(views, [torch.full_like(v, 2) for v in views])  # a straggling copy
assert all(bool((v == 2).all()) for v in views)
"""


def saved_views(connection, path: str) -> list:
    """Save through ``connection``; the pool views the save's copier keeps."""
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": torch.full((1 << 16,), 3.0)}, path)
    checkpoint.finalize_async_save(blocking=True)
    copier = handover.handover_for(connection).copier
    return [v for cached in copier._views.values() for v in cached]


def mapped(path: str) -> bool:
    with open("/proc/self/maps") as maps:
        return path in maps.read()


def test_views_of_a_closed_connections_pool_read_and_write_harmlessly(daemon):
    env = {**os.environ, "CKPTD_SOCKET": daemon.socket}
    child = subprocess.run([sys.executable, "-c", USE_VIEWS_AFTER_CLOSE,
                            os.path.join(daemon.roots[0], "a.pt")],
                           env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, f"exit {child.returncode}:\n{child.stderr}"


def test_a_closed_connection_maps_no_daemon_pages_and_keeps_no_handover(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    connection = connect()
    views = saved_views(connection, os.path.join(daemon.roots[0], "a.pt"))
    assert views and mapped(connection.pool_path)
    connection.close()
    assert not mapped(connection.pool_path), "the pool stayed mapped under the live views"
    assert connection not in handover._handovers
    with pytest.raises(DaemonUnavailableError, match="was closed"):
        connection.pool  # never mapped again: the daemon may be gone, its file with it
    with pytest.raises(DaemonUnavailableError, match="was closed"):
        handover.handover_for(connection).copier
    assert connection not in handover._handovers
