"""The pool directory: refused unless tmpfs or hugetlbfs; huge pages where the mount gives them.

Real mounts (root only, skipped elsewhere): a tmpfs per ``huge=`` option, a hugetlbfs, and a
tmpfs without huge pages whose pool gets them by folding (``MADV_COLLAPSE``).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from ckptd import knobs
from ckptd.staging.pool import StagingPool, pool_path_for_this_daemon, remove_stale_pools
from ckptd.staging.pool_directory import (PoolDirectoryError, check_pool_directory, mount_of)
from hugepages import file_huge_bytes, kernel_folds_tmpfs_pages
import mounts

mounted = mounts.mounted  # the fixture, under its name here

POOL = 8 << 20  # four huge pages


def test_dev_shm_is_a_tmpfs_pool_directory():
    found = check_pool_directory("/dev/shm")
    assert (found.path, found.filesystem) == ("/dev/shm", "tmpfs")


def test_a_directory_on_a_disk_filesystem_is_refused_naming_it_its_filesystem_and_the_fix(tmp_path):
    fstype, _ = mount_of(str(tmp_path))
    if fstype in ("tmpfs", "hugetlbfs"):
        pytest.skip(f"{tmp_path} is on {fstype} here; the test needs a disk directory")
    with pytest.raises(PoolDirectoryError) as info:
        check_pool_directory(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and f"is on {fstype}" in message
    assert "not tmpfs" in message and "--pool-dir" in message and "CKPTD_POOL_DIR" in message


def test_a_missing_directory_or_a_file_is_refused(tmp_path):
    with pytest.raises(PoolDirectoryError, match=f"{tmp_path}/gone does not exist.*--pool-dir"):
        check_pool_directory(str(tmp_path / "gone"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(PoolDirectoryError, match="is not a directory"):
        check_pool_directory(str(tmp_path / "file"))


def test_the_pool_directory_knob_places_new_pools_and_the_sweep(tmp_path, monkeypatch):
    assert knobs.POOL_DIR.get() == "/dev/shm" or "CKPTD_POOL_DIR" in os.environ
    monkeypatch.setenv("CKPTD_POOL_DIR", str(tmp_path))
    assert os.path.dirname(pool_path_for_this_daemon()) == str(tmp_path)
    finished = subprocess.Popen(["true"])
    finished.wait()
    dead = tmp_path / f"ckptd-{os.getuid()}-{finished.pid}-0badc0de"
    dead.write_bytes(b"x")
    assert remove_stale_pools() == ([str(dead)], [])


@pytest.mark.parametrize("huge", ["always", "within_size", "advise"])
def test_a_tmpfs_mounted_with_huge_pages_gives_the_pool_huge_pages(mounted, huge):
    directory = mounted("tmpfs", f"huge={huge},size=16m")
    assert check_pool_directory(directory).huge == huge
    pool = StagingPool(os.path.join(directory, "pool"), POOL)
    try:
        # advise: only because the pool asks with MADV_HUGEPAGE before its pages exist
        assert pool.huge_page_bytes > 0, f"no huge pages on a huge={huge} tmpfs"
        doc = pool.describe()
        assert (doc["directory"], doc["filesystem"], doc["huge"]) == (directory, "tmpfs", huge)
        assert doc["huge_page_bytes"] == pool.huge_page_bytes
    finally:
        pool.close()


def test_a_directory_the_daemon_cannot_write_is_refused_naming_the_fix(mounted):
    directory = mounted("tmpfs", "ro,size=1m")  # refused even to root
    with pytest.raises(PoolDirectoryError, match=f"{directory} is not writable.*mode=1777"):
        check_pool_directory(directory)


def test_a_tmpfs_without_huge_pages_reports_none_when_not_folded(mounted):
    directory = mounted("tmpfs", "size=16m")
    with knobs.override(POOL_COLLAPSE=False):
        pool = StagingPool(os.path.join(directory, "pool"), POOL)
    try:
        assert pool.huge_page_bytes == 0 and pool.describe()["huge"] == "never"
        assert file_huge_bytes(pool.path, POOL) == 0
    finally:
        pool.close()


def test_a_tmpfs_without_huge_pages_gets_them_by_folding_with_the_bytes_intact(mounted):
    reason = kernel_folds_tmpfs_pages()
    if reason:
        pytest.skip(reason)
    directory = mounted("tmpfs", "size=16m")
    pool = StagingPool(os.path.join(directory, "pool"), POOL + 4096)  # a last partial page
    try:
        assert pool.huge_page_bytes == POOL and pool.describe()["huge_page_bytes"] == POOL
        view = pool.view(pool.try_allocate(pool.size))
        pattern = os.urandom(12289)
        for offset in range(0, pool.size - len(pattern), 1 << 20):
            view[offset:offset + len(pattern)] = pattern
        assert file_huge_bytes(pool.path, POOL) == POOL
        with open(pool.path, "rb") as f:
            data = f.read()
        assert len(data) == pool.size
        for offset in range(0, pool.size - len(pattern), 1 << 20):
            assert data[offset:offset + len(pattern)] == pattern, offset
            assert data[offset + len(pattern):offset + (1 << 20)].count(0) == (1 << 20) - len(pattern)
        del view
    finally:
        pool.close()


def test_folding_a_pool_too_large_for_its_tmpfs_fails_with_the_fix_not_a_crash(mounted):
    directory = mounted("tmpfs", "size=4m")
    with pytest.raises(OSError, match=f"cannot reserve a {POOL}-byte staging pool.*"
                                      f"lower --pool-size or free space in {directory}"):
        StagingPool(os.path.join(directory, "pool"), POOL)
    assert os.listdir(directory) == []


def test_a_hugetlbfs_pool_is_rounded_to_its_page_size_or_refused_without_free_pages(mounted):
    directory = mounted("hugetlbfs", "pagesize=2M")
    assert check_pool_directory(directory).page_size == 2 << 20
    free = int(next(line.split()[1] for line in open("/proc/meminfo")
                    if line.startswith("HugePages_Free:")))
    if free * (2 << 20) >= POOL:
        pool = StagingPool(os.path.join(directory, "pool"), POOL - 4096)
        try:
            assert pool.size == POOL and pool.huge_page_bytes == POOL
        finally:
            pool.close()
        return
    with pytest.raises(OSError, match=f"{directory} is a hugetlbfs.*vm.nr_hugepages"):
        StagingPool(os.path.join(directory, "pool"), POOL)
    assert os.listdir(directory) == []


@pytest.fixture
def shm_dir():
    """A fresh directory on /dev/shm (a tmpfs, so only the checks under test can refuse it)."""
    import shutil
    import tempfile

    made = tempfile.mkdtemp(prefix="ckptd-test-dir-", dir="/dev/shm")
    yield __import__("pathlib").Path(made)
    shutil.rmtree(made, ignore_errors=True)


@pytest.mark.parametrize("mode,refused", [(0o777, True), (0o1777, False), (0o755, False)])
def test_a_directory_others_may_rename_files_in_is_refused(shm_dir, mode, refused):
    """Trainers open the pool by name: where another user may rename a file of theirs over
    it (writable by others, no sticky bit), the daemon refuses the directory."""
    directory = shm_dir / "pools"
    directory.mkdir()
    os.chmod(directory, mode)
    if not refused:
        assert check_pool_directory(str(directory)).path == str(directory)
        return
    with pytest.raises(PoolDirectoryError) as raised:
        check_pool_directory(str(directory))
    assert str(directory) in str(raised.value) and f"chmod 1777 {directory}" in str(raised.value)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_another_user_owns_is_refused_and_a_symlink_is_resolved(shm_dir):
    directory, link = shm_dir / "theirs", shm_dir / "link"
    directory.mkdir()
    link.symlink_to(directory)
    assert check_pool_directory(str(link)).path == str(directory)  # announced resolved
    os.chown(directory, 65534, 65534)
    with pytest.raises(PoolDirectoryError, match="belongs to uid 65534"):
        check_pool_directory(str(link))
