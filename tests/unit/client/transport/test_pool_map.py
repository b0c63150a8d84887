"""A closed connection retires its mapping of the daemon's pool, never unmaps it.

The pool's views are torch tensors (``torch.frombuffer``: no buffer export), so unmapping
the pool at close would leave them pointing at nothing: the copier's cached destinations,
a copy still running on another thread. These tests save through a real daemon, close
the connection, then use the views the save left behind: they must read and write
harmlessly (in a child process, so that a regression is a failed test, not a crashed
run), and the daemon's pool file must no longer be mapped here.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

from ckpt_client import TorchAsyncCheckpoint
from ckpt_client.errors import DaemonUnavailableError
from ckpt_client.transport import connection as connection_module
from ckpt_client.transport import handover, pool_map
from ckpt_client.transport.connection import connect
from ckptd import protocol
from ckptd import aligned_mapping

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


def held_open(path: str) -> bool:
    """Whether a descriptor of this process is open on ``path`` (unlinked or not)."""
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return any(name.startswith(path) for name in names)


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
    assert not held_open(connection.pool_path), "the pool file stayed open under the views"
    assert connection not in handover._handovers
    with pytest.raises(DaemonUnavailableError, match="was closed"):
        connection.pool  # never mapped again: the daemon may be gone, its file with it
    with pytest.raises(DaemonUnavailableError, match="was closed"):
        handover.handover_for(connection).copier
    assert connection not in handover._handovers


def test_the_pool_is_retired_before_the_daemon_hears_goodbye(daemon, monkeypatch):
    # On GOODBYE the daemon frees the extents of saves not staged yet: a copy still
    # running here must by then write into this process's memory alone.
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    connection = connect()
    call, heard = connection.call, []

    def call_noting_the_mapping(msg_type, *args, **kwargs):
        if msg_type == protocol.MessageType.GOODBYE:
            heard.append(mapped(connection.pool_path))
        return call(msg_type, *args, **kwargs)

    monkeypatch.setattr(connection, "call", call_noting_the_mapping)
    assert mapped(connection.pool_path)
    connection.close()
    assert heard == [False], "GOODBYE was sent while the daemon's pool was still mapped"


def test_a_zero_stall_save_on_a_closed_connection_fails_at_once(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    connection = connect()
    connection.close()
    threads = set(threading.enumerate())
    with pytest.raises(DaemonUnavailableError, match="was closed"):
        handover.stage(connection, protocol.SaveFormat.TORCH,
                       os.path.join(daemon.roots[0], "late.pt"), [torch.ones(4)],
                       zero_stall=True)
    assert set(threading.enumerate()) <= threads, "a stager started on a closed connection"


def test_closing_a_replaced_connection_leaves_its_successor_cached(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    old = connect()
    del connection_module._connections[old.socket_path]  # as if connect() had replaced it
    new = connect()
    assert new is not old
    old.close()
    assert connection_module._connections.get(new.socket_path) is new
    assert connect() is new
    new.close()


def test_a_failed_retirement_leaves_the_pool_mapped_and_says_so(tmp_path, monkeypatch, caplog):
    path = str(tmp_path / "pool")
    with open(path, "wb") as f:
        f.write(bytes([5]) * (1 << 20))
    pool = pool_map.map_pool(path, 1 << 20)

    def failing_mremap(*args):
        ctypes.set_errno(errno.ENOMEM)
        return ctypes.c_void_p(-1).value

    monkeypatch.setattr(aligned_mapping.libc, "mremap", failing_mremap)
    with caplog.at_level(logging.WARNING, logger=pool_map.__name__):
        pool_map.retire_pool(pool, path)
    assert "stays mapped" in caplog.text and "errno 12" in caplog.text
    assert mapped(path) and bool((pool == 5).all()), "a failed retirement changed the mapping"
    pool.fill_(6)  # still the file's pages
    with open(path, "rb") as f:
        assert f.read(4) == bytes([6]) * 4


def test_a_connection_marked_closed_without_hooks_gets_no_cached_handover(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    connection = connect()
    cached = handover.handover_for(connection)
    connection.closed = True  # as a forked child marks its parent's connections
    try:
        assert handover.handover_for(connection) is not cached
    finally:
        connection.closed = False
        connection.close()
