"""A staging pool in a tmpfs mounted with huge pages (``--pool-dir``), end to end.

The real daemon makes its pool in a ``huge=always`` tmpfs mounted for the test (root
only; skipped where the mount fails); saves in both formats load with stock readers; the
daemon, its writers and the trainer map the pool with huge pages; a SIGKILLed daemon's
pool there is swept by the next daemon; an auto-started daemon takes the directory from
``CKPTD_POOL_DIR``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from hugepages import kernel_folds_tmpfs_pages
from multirank import run_ranks, values
from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint, connect, dcp
from ckptd.staging.pool_directory import check_pool_directory, huge_page_bytes


@pytest.fixture
def huge_tmpfs(tmp_path):
    """A tmpfs mounted with ``huge=always`` (unmounted after the test)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path = tmp_path / "hugepool"
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=always,size=192m",
                           "hugepool-test", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a huge=always tmpfs here: {done.stderr.strip()}")
    yield str(path)
    subprocess.run(["umount", "-l", str(path)], check=False)


def pool_huge_bytes(pid: int | str, directory: str) -> int:
    """Bytes of process ``pid``'s mapping of a pool in ``directory`` on huge pages."""
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if f" {directory}/ckptd-" in line:
                return huge_page_bytes(int(line.split("-")[0], 16), pid)
    return 0


def state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3 << 20, generator=generator),  # 12 MiB: spans huge pages
            "odd": torch.arange(1001, dtype=torch.int16), "step": seed}


def save_both_formats_and_load(rank, world_size, root, directory):
    saved = state(7)
    torch_path = os.path.join(root, "model.pt")
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(saved, torch_path)
    checkpoint.finalize_async_save(blocking=True)
    loaded = torch.load(torch_path, weights_only=True)
    assert torch.equal(loaded["w"], saved["w"]) and torch.equal(loaded["odd"], saved["odd"])
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save(saved, os.path.join(root, "dcp")))
    assert queue.maybe_finalize_async_calls(blocking=True) == [0]
    fresh = {"w": torch.zeros(3 << 20), "odd": torch.zeros(1001, dtype=torch.int16), "step": 0}
    DCP.load(fresh, storage_reader=FileSystemReader(os.path.join(root, "dcp")))
    assert torch.equal(fresh["w"], saved["w"]) and fresh["step"] == 7
    return pool_huge_bytes("self", directory)


def test_a_pool_on_a_huge_page_tmpfs_saves_both_formats_on_huge_pages(start_daemon, huge_tmpfs,
                                                                      tmp_path):
    daemon = start_daemon(pool_size="64M", extra_args=("--pool-dir", huge_tmpfs))
    pool = daemon.status()["pool"]
    assert os.path.dirname(pool["path"]) == huge_tmpfs and pool["directory"] == huge_tmpfs
    assert (pool["filesystem"], pool["huge"]) == ("tmpfs", "always")
    assert pool["huge_page_bytes"] > 0, "status reports no huge pages on a huge=always tmpfs"
    assert "on huge pages" in daemon.log() and "4 KiB pages" not in daemon.log()
    [trainer_huge] = values(run_ranks(save_both_formats_and_load, 1, daemon.socket, tmp_path,
                                      args=(daemon.roots[0], huge_tmpfs)))
    assert trainer_huge > 0, "the trainer mapped the pool with 4 KiB pages"
    writers = [w["pid"] for w in daemon.status()["writers"]]
    # a writer maps the pool lazily: the one that wrote the 12 MiB tensor has huge pages
    assert max(pool_huge_bytes(pid, huge_tmpfs) for pid in writers) > 0
    assert pool_huge_bytes(daemon.pid, huge_tmpfs) == pool["huge_page_bytes"]
    table = status_table(daemon)
    assert f"in {huge_tmpfs} (tmpfs huge=always): " in table and "on huge pages" in table, table


def status_table(daemon) -> str:
    done = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", daemon.socket],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_pool_on_small_pages_says_so_and_how_to_get_huge_ones(start_daemon):
    if check_pool_directory("/dev/shm").may_have_huge_pages:
        pytest.skip("/dev/shm is mounted with huge pages here")
    daemon = start_daemon(env={"CKPTD_POOL_COLLAPSE": "0"})
    pool = daemon.status()["pool"]
    assert (pool["directory"], pool["huge"], pool["huge_page_bytes"]) == ("/dev/shm", "never", 0)
    advice = [line for line in daemon.log().splitlines() if "4 KiB pages" in line]
    assert len(advice) == 1 and "huge=within_size" in advice[0] and "--pool-dir" in advice[0]
    assert "in /dev/shm (tmpfs huge=never): 4 KiB pages" in status_table(daemon)


def test_a_sigkilled_daemons_pool_in_the_pool_directory_is_swept_by_the_next(start_daemon,
                                                                              huge_tmpfs):
    first = start_daemon(pool_size="32M", extra_args=("--pool-dir", huge_tmpfs))
    left = first.status()["pool"]["path"]
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(30)
    assert os.path.exists(left), "a SIGKILLed daemon cannot unlink its own pool"
    second = start_daemon(pool_size="32M", extra_args=("--pool-dir", huge_tmpfs))
    wait_for(lambda: not os.path.exists(left), 30, f"{left} to be swept")
    assert os.listdir(huge_tmpfs) == [os.path.basename(second.status()["pool"]["path"])]


def test_an_auto_started_daemon_takes_its_pool_directory_from_the_environment(
        huge_tmpfs, tmp_path, monkeypatch):
    socket_path = str(tmp_path / "auto" / "ckptd.sock")
    monkeypatch.setenv("CKPTD_AUTO_START", "1")
    monkeypatch.setenv("CKPTD_ROOTS", str(tmp_path))
    monkeypatch.setenv("CKPTD_POOL_SIZE", "32M")
    monkeypatch.setenv("CKPTD_POOL_DIR", huge_tmpfs)
    connection = connect(socket_path)
    try:
        assert os.path.dirname(connection.pool_path) == huge_tmpfs
    finally:
        pid = connection.daemon_pid
        connection.close()
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not os.path.exists(socket_path), 60, "the auto-started daemon to stop")


def skip_unless_dev_shm_folds() -> None:
    """Skip where a pool in /dev/shm is not folded into huge pages (the reason why)."""
    if check_pool_directory("/dev/shm").may_have_huge_pages:
        pytest.skip("/dev/shm is mounted with huge pages here: nothing to fold")
    reason = kernel_folds_tmpfs_pages()
    if reason:
        pytest.skip(reason)


def test_a_pool_in_dev_shm_gets_huge_pages_by_folding_and_the_writers_map_them(start_daemon,
                                                                              tmp_path):
    skip_unless_dev_shm_folds()
    daemon = start_daemon(pool_size="64M")
    pool = daemon.status()["pool"]
    assert (pool["directory"], pool["huge"], pool["huge_page_bytes"]) == ("/dev/shm", "never", 64 << 20)
    assert "given 64 MiB of huge pages" in daemon.log() and "4 KiB pages:" not in daemon.log()
    values(run_ranks(save_both_formats_and_load, 1, daemon.socket, tmp_path,
                     args=(daemon.roots[0], "/dev/shm")))
    writers = [w["pid"] for w in daemon.status()["writers"]]
    # the writers map the pool 2 MiB-aligned: the one that wrote the 12 MiB tensor pinned
    # huge pages, not 4 KiB ones
    assert max(pool_huge_bytes(pid, "/dev/shm") for pid in writers) > 0


def _disable_transparent_huge_pages() -> None:
    """In the daemon's process before it starts (inherited by its writers), as a container
    runtime or a parent may set it: the kernel then refuses MADV_COLLAPSE (EINVAL)."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(41, 1, 0, 0, 0) != 0:  # PR_SET_THP_DISABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_THP_DISABLE)")


def test_a_pool_the_kernel_refuses_to_fold_stays_on_small_pages_and_says_why_once(start_daemon,
                                                                               tmp_path):
    skip_unless_dev_shm_folds()
    daemon = start_daemon(pool_size="32M", preexec_fn=_disable_transparent_huge_pages)
    pool = daemon.status()["pool"]
    assert (pool["directory"], pool["huge"], pool["huge_page_bytes"]) == ("/dev/shm", "never", 0)
    [refused] = [line for line in daemon.log().splitlines() if "MADV_COLLAPSE" in line]
    assert "given 0 of 32 MiB" in refused and "PR_SET_THP_DISABLE" in refused, refused
    values(run_ranks(save_both_formats_and_load, 1, daemon.socket, tmp_path,
                     args=(daemon.roots[0], "/dev/shm")))
