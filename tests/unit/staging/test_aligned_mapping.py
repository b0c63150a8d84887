"""AlignedMapping: the boundary it maps a file at, what it says when it cannot, its views.

Real files in /dev/shm and real mounts (a hugetlbfs with 1 GiB pages: root only, skipped
where the kernel or the machine has none).
"""

from __future__ import annotations

import errno
import os

import pytest

from ckptd.aligned_mapping import HUGE_PAGE, AlignedMapping, alignment_of, thp_page_size
import mounts

mounted = mounts.mounted  # the fixture, under its name here

PMD_SIZE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"


@pytest.fixture
def shm_file():
    """``shm_file(size) -> (path, fd)``: a file in /dev/shm, open read-write, removed after."""
    made = []

    def make(size: int) -> tuple[str, int]:
        path = f"/dev/shm/ckptd-test-aligned-{os.getpid()}-{len(made)}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        made.append((path, fd))
        os.ftruncate(fd, size)
        return path, fd

    yield make
    for path, fd in made:
        os.close(fd)
        os.unlink(path)


def test_the_huge_page_size_is_the_kernels_and_2_mib_where_it_does_not_say(tmp_path):
    if os.path.exists(PMD_SIZE):
        with open(PMD_SIZE) as f:
            assert HUGE_PAGE == thp_page_size() == int(f.read())
    assert thp_page_size(str(tmp_path / "missing")) == 2 << 20
    (tmp_path / "odd").write_text("3000\n")
    assert thp_page_size(str(tmp_path / "odd")) == 2 << 20
    (tmp_path / "64k").write_text("65536\n")
    assert thp_page_size(str(tmp_path / "64k")) == 64 << 10


def test_a_tmpfs_file_is_mapped_at_a_huge_page_boundary(shm_file):
    path, fd = shm_file(4 << 20)
    assert alignment_of(fd) == HUGE_PAGE  # a tmpfs's own page is 4 KiB
    mapping = AlignedMapping(fd, 4 << 20, path)
    try:
        assert mapping.address % HUGE_PAGE == 0 and mapping.alignment == HUGE_PAGE
        mapping.view[:5] = b"bytes"
        assert os.pread(fd, 5, 0) == b"bytes"
    finally:
        mapping.close()


def test_a_read_only_file_is_refused_naming_it_its_errno_and_the_fix(shm_file):
    path, fd = shm_file(HUGE_PAGE)
    read_only = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(OSError) as raised:
            AlignedMapping(read_only, HUGE_PAGE, path)
    finally:
        os.close(read_only)
    assert raised.value.errno == errno.EACCES
    assert path in str(raised.value) and f"errno {errno.EACCES}" in str(raised.value)
    assert "read-write" in str(raised.value)


def _free_huge_pages(kib: int) -> int:
    try:
        with open(f"/sys/kernel/mm/hugepages/hugepages-{kib}kB/free_hugepages") as f:
            return int(f.read())
    except OSError:
        return 0


def test_a_file_on_a_1_gib_hugetlbfs_is_mapped_at_a_1_gib_boundary(mounted):
    """A hugetlbfs maps its files only at multiples of its page size: aligned to 2 MiB, a
    pool on 1 GiB pages could not be mapped at all (EINVAL) and the daemon did not start.
    Without a free 1 GiB page the mapping fails for that reason, and says what to do."""
    if not os.path.isdir("/sys/kernel/mm/hugepages/hugepages-1048576kB"):
        pytest.skip("this kernel or machine has no 1 GiB huge pages")
    directory = mounted("hugetlbfs", "pagesize=1G")
    path = os.path.join(directory, "pool")
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 1 << 30)
        assert alignment_of(fd) == 1 << 30
        if _free_huge_pages(1 << 20) >= 1:
            mapping = AlignedMapping(fd, 1 << 30, path)
            assert mapping.address % (1 << 30) == 0
            mapping.close()
            return
        with pytest.raises(OSError) as raised:
            AlignedMapping(fd, 1 << 30, path)
        assert raised.value.errno == errno.ENOMEM, raised.value  # not EINVAL: the boundary is right
        message = str(raised.value)
        assert path in message and "1 GiB boundary" in message and "errno 12" in message
        assert "hugepages-1048576kB/nr_hugepages" in message
    finally:
        os.close(fd)
        os.unlink(path)


def test_close_refuses_while_a_view_is_alive_as_pythons_mmap_does(shm_file):
    """A view outliving the mapping would read unmapped memory (a segfault): close raises
    BufferError instead, the mapping stays usable, and closes once the view is gone."""
    path, fd = shm_file(HUGE_PAGE)
    mapping = AlignedMapping(fd, HUGE_PAGE, path)
    part = mapping.view[10:20]
    with pytest.raises(BufferError, match="views of it are still alive"):
        mapping.close()
    mapping.view[10:14] = b"kept"
    assert bytes(part[:4]) == b"kept"
    part.release()
    mapping.close()
    mapping.close()  # a second close does nothing
    with pytest.raises(ValueError):
        mapping.view[0]  # released: Python refuses, nothing reads unmapped memory
