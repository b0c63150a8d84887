"""Direct writes: the bytes on disk are the bytes given, the checksum covers exactly them, the
write mode is decided per filesystem, and a filesystem that refuses O_DIRECT still works."""

import fcntl
import logging
import mmap
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from ckptd import knobs
from ckptd.checksum import algorithm_named, checksum_bytes, read_sidecar, verify_file
from ckptd.storage import direct_io, write_modes
from ckptd.storage.durable import DurableFile, write_file_atomically
from ckptd.storage.jobs import WriteTorch

from pool_fixtures import pool_path, writer  # noqa: F401 (fixtures)
from test_writer_process import put, run

PAGE = direct_io.PAGE


def page_aligned(nbytes: int, fill: int) -> memoryview:
    """A page-aligned writable buffer (as a staging pool extent is) of ``nbytes``."""
    buffer = mmap.mmap(-1, max(nbytes, 1))
    buffer[:nbytes] = bytes((fill + i) % 251 for i in range(min(nbytes, 251))) * \
        (nbytes // 251) + bytes((fill + i) % 251 for i in range(nbytes % 251))
    return memoryview(buffer)[:nbytes]


def test_the_file_holds_every_byte_in_order_whatever_each_piece_is(tmp_path):
    pieces = [b"header", page_aligned(0, 1), page_aligned(PAGE, 2),
              b"z" * (-(6 + PAGE) % PAGE),                      # back on a page boundary
              page_aligned(PAGE, 3), page_aligned(PAGE + 1, 4),  # ends on / just past a page
              bytes(-(PAGE + PAGE + 1 + 6 + -(6 + PAGE) % PAGE) % PAGE),
              page_aligned(3 * (1 << 20) + 5, 5), bytearray(b"unaligned tail" * 1000),
              page_aligned(70_000, 6)[1:]]                      # a view off its page
    expected = b"".join(bytes(p) for p in pieces)
    with knobs.override(DIRECT_CHUNK_BYTES=1 << 20, DIRECT_BOUNCE_BYTES=64 << 10,
                        DIRECT_MIN_BYTES=PAGE, CHECKSUM="crc32c"):
        with DurableFile(str(tmp_path / "f"), direct=True) as durable:
            assert isinstance(durable.stream, direct_io.DirectFileWriter)
            assert fcntl.fcntl(durable.stream.fileno(), fcntl.F_GETFL) & os.O_DIRECT
            for piece in pieces:
                durable.stream.write(piece)
            checksum = durable.commit()
    assert (tmp_path / "f").read_bytes() == expected
    assert checksum == checksum_bytes(expected, "crc32c") == read_sidecar(str(tmp_path / "f"))
    verify_file(str(tmp_path / "f"))


@pytest.mark.parametrize("nbytes", [0, 1, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE])
def test_sizes_around_a_page_come_out_exact(tmp_path, nbytes):
    data = page_aligned(nbytes, 7)
    with knobs.override(DIRECT_MIN_BYTES=PAGE):
        result = write_file_atomically(str(tmp_path / "f"), lambda s: s.write(data), direct=True)
    assert (tmp_path / "f").read_bytes() == bytes(data) and result["size"] == nbytes


@pytest.mark.parametrize("step", [0, PAGE, 1 << 20, 64 << 20])
def test_space_allocated_ahead_is_given_back_and_the_bytes_are_exact(tmp_path, step):
    # Writes go into space allocated ahead in steps (so the threads write side by side);
    # the committed file has exactly its bytes and holds no block past its end.
    data = page_aligned(3 * (1 << 20) + 5, 9)
    with knobs.override(DIRECT_ALLOCATE_BYTES=step, DIRECT_CHUNK_BYTES=1 << 20):
        with DurableFile(str(tmp_path / "f"), direct=True) as durable:
            if not isinstance(durable.stream, direct_io.DirectFileWriter):
                pytest.skip(f"{tmp_path} refuses O_DIRECT ({durable.write_mode})")
            durable.stream.write(b"head")
            durable.stream.write(bytes(PAGE - 4))
            durable.stream.write(data)
            durable.commit()
    path = tmp_path / "f"
    assert path.read_bytes() == b"head" + bytes(PAGE - 4) + bytes(data)
    verify_file(str(path))
    allocated = os.stat(path).st_blocks * 512
    assert allocated <= -(-os.path.getsize(path) // PAGE) * PAGE + (1 << 20), \
        f"{allocated} bytes still allocated to a {os.path.getsize(path)}-byte file"


@pytest.mark.parametrize("hint", [0, PAGE, 3 * (1 << 20) + 5, 3 * (1 << 20) + PAGE + 5,
                                  64 << 20])
def test_space_allocated_up_front_from_a_size_hint_leaves_the_file_exact(tmp_path, hint):
    # The caller's idea of the file's size (under it, exact, or wrong and too large) is
    # allocated before the first write; the file holds its bytes and no block past them.
    data = page_aligned(3 * (1 << 20) + 5, 4)
    with knobs.override(DIRECT_CHUNK_BYTES=1 << 20):
        result = write_file_atomically(
            str(tmp_path / "f"), lambda s: (s.write(b"x" * PAGE), s.write(data)),
            direct=True, size_hint=hint)
    path = tmp_path / "f"
    assert path.read_bytes() == b"x" * PAGE + bytes(data)
    assert result["size"] == os.path.getsize(path) == PAGE + data.nbytes
    verify_file(str(path))
    allocated = os.stat(path).st_blocks * 512
    assert allocated <= -(-os.path.getsize(path) // PAGE) * PAGE + (8 << 20), \
        f"{allocated} bytes still allocated to a {os.path.getsize(path)}-byte file"


def test_an_exact_size_hint_is_the_one_allocation_of_the_file(tmp_path, monkeypatch):
    """Allocating past a file's end waits for every direct write in flight: given the
    file's exact size (a DCP file's, from its layout), the writer allocates once, before
    its first write, in whole pages (the last is written padded), and never again."""
    fd = os.open(str(tmp_path), os.O_RDONLY)
    try:
        pays = direct_io.fallocate is not None and direct_io.allocating_ahead_pays(fd)
    finally:
        os.close(fd)
    if not pays:
        pytest.skip("this filesystem does not allocate ahead (tmpfs, or no fallocate)")
    calls = []
    real = direct_io.fallocate

    def counted(fd, mode, offset, length):
        calls.append((offset, length))
        return real(fd, mode, offset, length)

    monkeypatch.setattr(direct_io, "fallocate", counted)
    data = page_aligned(3 * (1 << 20) + 5, 4)
    size = PAGE + data.nbytes  # not a whole number of pages
    with knobs.override(DIRECT_CHUNK_BYTES=1 << 20):
        write_file_atomically(str(tmp_path / "f"),
                              lambda s: (s.write(b"x" * PAGE), s.write(data)),
                              direct=True, size_hint=size)
    assert (tmp_path / "f").read_bytes() == b"x" * PAGE + bytes(data)
    assert calls == [(0, -(-size // PAGE) * PAGE)], calls


def test_a_failed_direct_write_leaves_nothing(tmp_path):
    def body(stream):
        stream.write(page_aligned(1 << 20, 1))
        raise RuntimeError("serializer failed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        write_file_atomically(str(tmp_path / "f"), body, direct=True)
    assert os.listdir(tmp_path) == []


def test_the_buffered_knob_writes_through_the_page_cache(tmp_path):
    with knobs.override(WRITE_MODE="buffered"):
        with DurableFile(str(tmp_path / "f"), direct=True) as durable:
            assert not isinstance(durable.stream, direct_io.DirectFileWriter)
            durable.stream.write(b"abc")
            durable.commit()
    assert (tmp_path / "f").read_bytes() == b"abc"


@pytest.mark.parametrize("shape,dtype", [([1024], "float32"),      # ends exactly on a page
                                         ([1025], "float32"),      # just past one
                                         ([0], "float32"), ([3, 0], "bfloat16"),
                                         ([17, 33], "float16"), ([4097], "int8"),
                                         ([50_001], "float64"), ([7], "bool")])
def test_torch_files_written_direct_load_with_stock_torch(writer, tmp_path, shape, dtype):
    tensors = [torch.arange(max(1, torch.Size(shape).numel()))[:torch.Size(shape).numel()]
               .to(getattr(torch, dtype)).view(shape), torch.arange(5, dtype=torch.int64)]
    specs, offset = [], 0
    for tensor in tensors:
        specs.append(put(writer, offset, tensor))
        offset += -(-max(tensor.numel() * tensor.element_size(), 1) // PAGE) * PAGE
    from ckptd import protocol
    skeleton = protocol.pack_value({"t": protocol.TensorRef(0), "n": [protocol.TensorRef(1)]})
    path = str(tmp_path / "m.pt")
    with knobs.override(DIRECT_MIN_BYTES=PAGE):
        assert run(writer, WriteTorch(path, skeleton, specs, offset)).ok
    for mmap_mode in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=mmap_mode)
        assert torch.equal(loaded["t"], tensors[0]) and torch.equal(loaded["n"][0], tensors[1])
    verify_file(path)


# ---------------------------------------------------------------- a filesystem without O_DIRECT

@pytest.fixture
def ramfs(tmp_path, monkeypatch):
    """A ramfs mount: it refuses O_DIRECT (tmpfs accepts it on this kernel). A fresh
    mount may get the device number of one an earlier test unmounted: the writers' record
    of what each device takes starts empty, so it is this mount's answer that counts."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a ramfs needs root and mount(8)")
    from ckptd.storage import direct_io, write_modes

    monkeypatch.setattr(write_modes, "_modes", {})
    mount_point = tmp_path / f"wp-ramfs-{uuid.uuid4().hex[:6]}"
    mount_point.mkdir()
    subprocess.run(["mount", "-t", "ramfs", "ckptd-test-ramfs", str(mount_point)], check=True)
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_filesystem_refusing_o_direct_gets_buffered_writes_logged_once(ramfs, caplog):
    with pytest.raises(OSError):
        os.close(os.open(ramfs / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    os.unlink(ramfs / "probe")  # created, then refused
    caplog.set_level(logging.INFO, logger=write_modes.__name__)
    for name in ("a", "b"):
        data = page_aligned(3 * PAGE + 5, 9)
        with DurableFile(str(ramfs / name), direct=True) as durable:
            assert not isinstance(durable.stream, direct_io.DirectFileWriter)
            durable.stream.write(data)
            durable.commit()
        assert (ramfs / name).read_bytes() == bytes(data)
        verify_file(str(ramfs / name))
    lines = [r.getMessage() for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(lines) == 1, lines
    assert write_modes.probe_directory(str(ramfs)).mode == "buffered"
    assert write_modes.probe_directory(str(ramfs.parent)).mode == "direct"  # ext4 / tmpfs
    assert sorted(os.listdir(ramfs)) == ["a", "a.ckptd-sum", "b", "b.ckptd-sum"]



def test_a_batch_cut_short_by_the_kernel_is_written_to_its_end(tmp_path, monkeypatch):
    # pwritev may write less than asked (a signal, a full device making room): the rest of
    # the batch, from inside a segment, is written at the right offset, checksummed once.
    segments = [(memoryview(bytes([n]) * size), size) for n, size in
                enumerate([PAGE, 3 * PAGE, 5, 2 * PAGE + 7])]
    real = os.pwritev
    calls = []

    def short(fd, views, offset):
        calls.append(offset)
        return real(fd, [memoryview(b"".join(bytes(v) for v in views))[:PAGE + 3]], offset)

    monkeypatch.setattr(direct_io.os, "pwritev", short)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        direct_io._write_batch(fd, [view for view, _ in segments], 10)
    finally:
        os.close(fd)
    expected = b"".join(bytes(v) for v, _ in segments)
    assert (tmp_path / "f").read_bytes()[10:] == expected and len(calls) > 1
    summed = direct_io._checksum_batch(segments, 10, algorithm_named("crc32c").update)
    assert summed == (10, len(expected), checksum_bytes(expected, "crc32c").value)


def write_direct(path: str, pieces: list, **knob_values):
    """Write ``pieces`` into a direct file at ``path`` with these knobs and crc32c; its
    checksum (skipped where the filesystem refuses O_DIRECT)."""
    with knobs.override(CHECKSUM="crc32c", **knob_values):
        with DurableFile(path, direct=True) as durable:
            if not isinstance(durable.stream, direct_io.DirectFileWriter):
                pytest.skip(f"{path} refuses O_DIRECT ({durable.write_mode})")
            for piece in pieces:
                durable.stream.write(piece)
            return durable.commit()


def test_headers_between_tensors_share_a_bounce_buffer_and_every_byte_lands(tmp_path,
                                                                            monkeypatch):
    # A record's header goes through the bounce buffer, its tensor straight from the pool;
    # the next header goes on in the same buffer, a page further (a buffer per header ran
    # a file of many tensors out of buffers within a chunk: it waited for the disk).
    taken = []
    real_take = direct_io.DirectFileWriter._take_buffer

    def counting(self):
        taken.append(1)
        return real_take(self)

    monkeypatch.setattr(direct_io.DirectFileWriter, "_take_buffer", counting)
    pieces = []
    for n in range(60):
        pieces += [bytes([n]) * 100, bytes(PAGE - 100), page_aligned((n % 3 + 1) * PAGE, n)]
    pieces.append(b"end")
    expected = b"".join(bytes(p) for p in pieces)
    checksum = write_direct(str(tmp_path / "f"), pieces, DIRECT_BOUNCE_BYTES=4 * PAGE,
                            DIRECT_CHUNK_BYTES=16 * PAGE, DIRECT_MIN_BYTES=PAGE)
    assert (tmp_path / "f").read_bytes() == expected
    assert checksum == checksum_bytes(expected, "crc32c") == read_sidecar(str(tmp_path / "f"))
    assert len(taken) <= 60 // 4 + 1, f"{len(taken)} bounce buffers for 60 one-page headers"


def test_a_file_reusing_the_bounce_buffers_of_the_one_before_holds_only_its_own_bytes(
        tmp_path, monkeypatch):
    # Bounce buffers go from one file to the next (a fresh mapping costs a page fault a
    # page): what the first file left in them must never reach the second.
    monkeypatch.setattr(direct_io, "_spare_buffers", [])
    first = [b"\xff" * 5000] * 40
    second = [b"ab" * 700, b"c", b"de" * 3000]
    with knobs.override(DIRECT_BOUNCE_BYTES=16 << 10, DIRECT_CHUNK_BYTES=64 << 10,
                        DIRECT_MIN_BYTES=PAGE):
        for name, pieces in (("first", first), ("second", second)):
            with DurableFile(str(tmp_path / name), direct=True) as durable:
                if not isinstance(durable.stream, direct_io.DirectFileWriter):
                    pytest.skip(f"{tmp_path} refuses O_DIRECT ({durable.write_mode})")
                for piece in pieces:
                    durable.stream.write(piece)
                durable.commit()
            if name == "first":
                kept = {id(b) for b in direct_io._spare_buffers}
                assert kept, "a finished file gives its bounce buffers back"
    assert kept & {id(b) for b in direct_io._spare_buffers}, "the second file reused them"
    assert (tmp_path / "second").read_bytes() == b"".join(second)
    assert (tmp_path / "first").read_bytes() == b"".join(first)
    verify_file(str(tmp_path / "second"))


def test_batches_end_where_the_file_crosses_a_multiple_of_the_chunk(tmp_path, monkeypatch):
    # The kernel cuts each write into the disk's largest requests from the write's own
    # start: a batch a chunk long from wherever it began (after a header, say) left a short
    # request at every batch's end. Cut at the chunk's multiples, only the last may be short.
    batches = []
    real_write = direct_io._write_batch

    def recording(fd, views, offset):
        batches.append((offset, sum(view.nbytes for view in views)))
        return real_write(fd, views, offset)

    monkeypatch.setattr(direct_io, "_write_batch", recording)
    chunk = 16 * PAGE
    pieces = [b"h" * 100, bytes(PAGE - 100), page_aligned(5 * chunk + 3 * PAGE, 1),
              b"small record", bytes(PAGE - 12), page_aligned(2 * chunk, 2), b"tail"]
    expected = b"".join(bytes(p) for p in pieces)
    checksum = write_direct(str(tmp_path / "f"), pieces, DIRECT_CHUNK_BYTES=chunk,
                            DIRECT_MIN_BYTES=PAGE, DIRECT_IDLE_BATCH_BYTES=1 << 40)
    assert (tmp_path / "f").read_bytes() == expected
    assert checksum == checksum_bytes(expected, "crc32c")
    batches.sort()
    assert [offset for offset, _ in batches] == [n * chunk for n in range(len(batches))]
    assert all(length == chunk for _, length in batches[:-1]), batches
    assert batches[-1][0] + batches[-1][1] == -(-len(expected) // PAGE) * PAGE
