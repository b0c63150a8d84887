"""Replicas written in pieces with O_DIRECT: the file holds exactly the bytes given, whatever
the order, the threads and the tail; a piece that cannot go direct switches the file to
buffered writes instead of being refused or padding over a neighbour; a filesystem that
refuses O_DIRECT still gets the part."""

import fcntl
import logging
import os
import threading

import pytest

from ckptd.checksum import checksum_bytes, read_sidecar, verify_file
from ckptd.storage import direct_io, direct_pieces
from ckptd.storage.local_store import PartReceiver

from test_direct_io import page_aligned, ramfs  # noqa: F401 (fixture)

PAGE = direct_io.PAGE


def direct_flag(receiver: PartReceiver) -> bool:
    return bool(fcntl.fcntl(receiver._file.stream.fileno(), fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("size", [PAGE, 3 * PAGE + 1, 5 * PAGE - 1, 2 * PAGE * 7 + 123])
def test_aligned_pieces_from_several_threads_in_any_order_stay_direct(tmp_path, size):
    chunk = 2 * PAGE
    data = page_aligned(size, 3)
    receiver = PartReceiver(str(tmp_path / "part"), size, "crc32c")
    if receiver._file._pieces is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({receiver._file.write_mode})")
    offsets = list(range(0, size, chunk))[::-1]

    def write(offset):  # each piece from its own page-aligned buffer, as a connection's
        piece = page_aligned(min(chunk, size - offset), 0)
        piece[:] = data[offset:offset + piece.nbytes]
        assert receiver.write(offset, piece)

    threads = [threading.Thread(target=write, args=(o,)) for o in offsets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert direct_flag(receiver) and not receiver._file._pieces.buffered
    checksum = receiver.finish()
    assert (tmp_path / "part").read_bytes() == bytes(data)  # the tail's padding is cut
    assert checksum == checksum_bytes(bytes(data), "crc32c") == read_sidecar(str(tmp_path / "part"))
    verify_file(str(tmp_path / "part"))


@pytest.mark.parametrize("order", ["unaligned first", "unaligned last"])
def test_a_piece_off_the_pages_switches_the_file_to_buffered_writes(tmp_path, caplog, order):
    # 0..5000 ends off a page and is not the file's end: padding it to a page would
    # overwrite the first bytes of the piece at 5000
    data = page_aligned(9000, 5)
    pieces = [(0, page_aligned(5000, 0)), (5000, page_aligned(4000, 0))]
    for offset, piece in pieces:
        piece[:] = data[offset:offset + piece.nbytes]
    receiver = PartReceiver(str(tmp_path / "part"), 9000)
    if receiver._file._pieces is None:
        pytest.skip(f"{tmp_path} refuses O_DIRECT ({receiver._file.write_mode})")
    caplog.set_level(logging.INFO, logger=direct_pieces.__name__)
    for offset, piece in pieces if order == "unaligned first" else pieces[::-1]:
        receiver.write(offset, piece)
    assert receiver._file._pieces.buffered and not direct_flag(receiver)
    assert any("page cache" in r.getMessage() for r in caplog.records)
    receiver.finish()
    assert (tmp_path / "part").read_bytes() == bytes(data)


def test_a_filesystem_refusing_o_direct_still_receives_the_part(ramfs):  # noqa: F811
    data = page_aligned(3 * PAGE + 7, 9)
    receiver = PartReceiver(str(ramfs / "part"), data.nbytes)
    assert receiver._file._pieces is None, "ramfs takes no direct writes"
    receiver.write(2 * PAGE, data[2 * PAGE:])
    receiver.write(0, data[:2 * PAGE])
    receiver.finish()
    assert (ramfs / "part").read_bytes() == bytes(data)
    verify_file(str(ramfs / "part"))


def test_space_is_allocated_ahead_on_a_disk_but_not_on_tmpfs(tmp_path):
    # tmpfs zeroes each page it allocates and the write then copies over it: a pass over
    # the bytes for nothing; on a disk the reservation keeps writes from extending the file
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize < 1 << 24:
        pytest.skip("no tmpfs with room at /dev/shm")
    size = 8 * PAGE + 5
    seen = {}
    for where in (str(tmp_path), shm):
        path = os.path.join(where, f"ckptd-test-pieces-{os.getpid()}")
        receiver = PartReceiver(path, size)
        try:
            fd = receiver._file.stream.fileno()
            seen[where] = (direct_io.allocating_ahead_pays(fd), os.fstat(fd).st_size)
            data = page_aligned(size, 1)
            receiver.write(0, data)
            receiver.finish()
            with open(path, "rb") as f:
                assert f.read() == bytes(data)
        finally:
            for name in (path, path + ".ckptd-sum"):
                if os.path.exists(name):
                    os.unlink(name)
    assert seen[shm] == (False, 0), "nothing allocated ahead on tmpfs"
    if seen[str(tmp_path)][0]:  # a filesystem that can allocate
        assert seen[str(tmp_path)][1] == size
