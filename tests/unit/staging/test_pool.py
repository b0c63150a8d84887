"""The staging pool: real shared memory, extents, FIFO back-pressure."""

import fcntl
import os
import subprocess
import sys

import pytest
import torch

from conftest import hold_lock

from ckptd.staging.pool import Extent, PoolTooSmallError, StagingPool
from ckptd.protocol import EXTENT_ALIGNMENT


@pytest.fixture
def pool(tmp_path):
    p = StagingPool(f"/dev/shm/ckptd-test-{os.getpid()}-{tmp_path.name}", 16 * EXTENT_ALIGNMENT)
    yield p
    p.close()


def test_segment_exists_while_open_and_is_unlinked_on_close(pool):
    assert os.path.exists(pool.path) and os.stat(pool.path).st_size == pool.size
    assert os.stat(pool.path).st_mode & 0o777 == 0o600
    pool.close()
    assert not os.path.exists(pool.path)


def test_extents_do_not_overlap_and_space_comes_back(pool):
    a = pool.try_allocate(3 * EXTENT_ALIGNMENT)
    b = pool.try_allocate(5)
    assert a.offset + a.length <= b.offset
    assert pool.used_bytes == 4 * EXTENT_ALIGNMENT
    pool.release(a)
    pool.release(b)
    assert pool.free_bytes == pool.size
    assert pool.try_allocate(pool.size) == Extent(0, pool.size)  # holes merged again


def test_a_request_larger_than_the_pool_is_refused(pool):
    with pytest.raises(PoolTooSmallError, match="--pool-size.*CKPTD_POOL_SIZE"):
        pool.try_allocate(pool.size + 1)


def test_waiters_get_space_in_fifo_order_and_nobody_overtakes(pool):
    held = pool.try_allocate(12 * EXTENT_ALIGNMENT)
    assert pool.try_allocate(8 * EXTENT_ALIGNMENT) is None
    pool.wait_for(8 * EXTENT_ALIGNMENT, "first")
    # Fits in what is free now, but must not overtake the waiter.
    assert pool.try_allocate(EXTENT_ALIGNMENT) is None
    pool.wait_for(EXTENT_ALIGNMENT, "second")
    granted = pool.release(held)
    assert [token for token, _ in granted] == ["first", "second"]
    assert pool.waiting == 0


def test_cancelled_waiter_gets_nothing(pool):
    held = pool.try_allocate(pool.size)
    pool.wait_for(EXTENT_ALIGNMENT, "gone")
    pool.cancel_wait("gone")
    assert pool.release(held) == []


def test_staged_bytes_are_visible_through_the_shared_file(pool):
    extent = pool.try_allocate(EXTENT_ALIGNMENT)
    pool.view(extent)[:5] = b"hello"
    with open(pool.path, "rb") as f:
        f.seek(extent.offset)
        assert f.read(5) == b"hello"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_pool_that_does_not_fit_fails_at_start_with_a_clear_error(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        with pytest.raises(OSError, match="lower --pool-size"):
            StagingPool(str(mount / "pool"), 64 << 20)
        assert not os.path.exists(mount / "pool")
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_pools_of_dead_daemons_are_removed_and_live_ones_kept(tmp_path):
    from ckptd.staging.pool import remove_stale_pools

    finished = subprocess.Popen(["true"])
    finished.wait()
    exiting = subprocess.Popen(["sleep", "600"])  # a daemon still running (or still exiting)
    dead = tmp_path / f"ckptd-{os.getuid()}-{finished.pid}-0badc0de"
    own = tmp_path / f"ckptd-{os.getuid()}-{os.getpid()}-0000cafe"
    later = tmp_path / f"ckptd-{os.getuid()}-{exiting.pid}-00c0ffee"
    other = tmp_path / "ckptd-notes.txt"
    for path in (dead, own, later, other):
        path.write_bytes(b"x")
    try:
        assert remove_stale_pools(str(tmp_path)) == ([str(dead)], [exiting.pid])
        assert own.exists() and later.exists() and other.exists() and not dead.exists()
    finally:
        exiting.kill()
        exiting.wait()
    # once its owner is gone, the next sweep removes it: a successor looks again
    assert remove_stale_pools(str(tmp_path)) == ([str(later)], [])
    assert own.exists() and other.exists()


def test_cancelling_the_head_waiter_lets_the_next_one_in(pool):
    held = pool.try_allocate(12 * EXTENT_ALIGNMENT)
    pool.wait_for(8 * EXTENT_ALIGNMENT, "too big for now")
    pool.wait_for(2 * EXTENT_ALIGNMENT, "fits already")
    granted = pool.cancel_wait("too big for now")
    assert [token for token, _ in granted] == ["fits already"]
    pool.release(held)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_pool_whose_lock_is_held_stays_and_foreign_names_are_left_alone(tmp_path):
    """A daemon in another pid namespace sharing the directory looks dead here by its pid;
    its pool's lock says otherwise. A symlink or a file of another user named like one of
    our pools is never touched (nor reported: nothing to wait for)."""
    from ckptd.staging.pool import remove_stale_pools

    finished = subprocess.Popen(["true"])
    finished.wait()
    held = tmp_path / f"ckptd-{os.getuid()}-{finished.pid}-0badc0de"
    held.write_bytes(b"x")
    holder = hold_lock(held)
    target = tmp_path / "precious"
    target.write_bytes(b"not a pool")
    link = tmp_path / f"ckptd-{os.getuid()}-{finished.pid}-11111111"
    link.symlink_to(target)
    foreign = tmp_path / f"ckptd-{os.getuid()}-{finished.pid}-22222222"
    foreign.write_bytes(b"x")
    os.chown(foreign, 65534, 65534)
    try:
        assert remove_stale_pools(str(tmp_path)) == ([], [finished.pid])
        assert held.exists() and link.is_symlink() and target.exists() and foreign.exists()
    finally:
        holder.kill()
        holder.wait()
    assert remove_stale_pools(str(tmp_path)) == ([str(held)], [])  # its holder is gone
    assert link.is_symlink() and target.exists() and foreign.exists()


USE_A_VIEW_AFTER_CLOSE = r"""
import os
import sys
import torch
from ckptd.staging.pool import StagingPool

pool = StagingPool(sys.argv[1], 1 << 22)
view = torch.frombuffer(pool._map, dtype=torch.uint8)  # as the CUDA stager views it
view.fill_(1)
pool.close()
with open("/proc/self/maps") as maps:
    assert sys.argv[1] not in maps.read(), "the closed pool is still mapped"
open_files = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
              if os.path.exists(f"/proc/self/fd/{fd}")]
assert not any(f.startswith(sys.argv[1]) for f in open_files), (
    f"the closed pool is still open (its pages are not freed): {open_files}")
assert not view.any(), "the view still reads the pool's bytes"
view.fill_(2)  # a device worker's copy that outlived its join
assert bool((view == 2).all())
"""


def test_a_view_of_a_closed_pool_reads_and_writes_harmlessly_and_frees_the_file(tmp_path):
    # In a child: a regression crashes it (SIGSEGV), not the test run.
    path = f"/dev/shm/ckptd-test-{os.getpid()}-{tmp_path.name}"
    try:
        child = subprocess.run([sys.executable, "-c", USE_A_VIEW_AFTER_CLOSE, path],
                               capture_output=True, text=True, timeout=300)
        assert child.returncode == 0, f"exit {child.returncode}:\n{child.stderr}"
        assert not os.path.exists(path)
    finally:
        if os.path.exists(path):  # the child failed before its close
            os.unlink(path)


def test_a_closed_pool_releases_its_lock_while_a_view_lives(tmp_path):
    path = f"/dev/shm/ckptd-test-{os.getpid()}-{tmp_path.name}"
    pool = StagingPool(path, 1 << 22)
    try:
        view = torch.frombuffer(pool._map, dtype=torch.uint8)
        fd = os.open(path, os.O_RDONLY)
    finally:
        pool.close()
    try:  # the file is unlinked, but still reachable through our descriptor
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # no BlockingIOError: nobody holds it
    finally:
        os.close(fd)
    assert not view.any()
