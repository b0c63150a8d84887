"""Direct writes: file bytes go from the staging pool to the device, not via the page cache.

Owns two things a writer needs to write with ``O_DIRECT``:

- :func:`write_mode_of`: whether a filesystem takes direct writes, decided once per
  filesystem (``statx``'s DIO alignment where the kernel reports it, else whether it
  accepts ``O_DIRECT`` at all) and logged once. Where it does not (ramfs, some FUSE and
  network mounts, or an alignment above a page), files are written buffered and their
  pages dropped from the page cache after the fsync (``posix_fadvise(DONTNEED)``).
- :class:`DirectFileWriter`: the stream a direct file's bytes are written into. A write
  that starts on a page boundary of the file, from a page-aligned buffer of the pool,
  goes to the disk as it is, in large chunks written by a few threads (``pwritev``
  releases the GIL), each chunk checksummed by the thread that writes it; everything else
  (zip headers, padding, small tensors, the unaligned tail of a large one) is gathered in
  a small page-aligned bounce buffer written the same way. Consecutive pieces (bounce
  buffers, tensors) are gathered into one ``pwritev`` of up to a chunk, so a file of a
  thousand records costs about one hand-over to a thread per chunk, not one per record.
  The file's last page is written whole and the file truncated to its size. Space is allocated ahead of the writes
  (``fallocate``): a direct write past the end of a file takes the inode's lock alone and
  waits for the disk under it, so the threads' writes would queue one behind the other;
  into allocated space they run side by side (not on tmpfs: :func:`allocating_ahead_pays`).

The file layouts cooperate: ckptd's torch files start every record's data on a 4 KiB
boundary (torch's ``storage_alignment``), DCP items start on one, and the staging extent
places large tensors on page boundaries (``ckptd.protocol.layout_extent``), so tensor
bodies are never copied. Pattern: aligned bounce buffer + chunked positional writes.
No torch; no sockets.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import logging
import mmap
import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ckptd import knobs
from ckptd.checksum import Checksum, algorithm_named, combine_pieces
from ckptd.filesystems import TMPFS_MAGIC, statfs

log = logging.getLogger(__name__)

__all__ = ["PAGE", "WriteMode", "write_mode_of", "probe_directory", "DirectFileWriter",
           "drop_cached_pages", "buffer_address", "fallocate", "allocating_ahead_pays"]

#: The unit of a direct write: file offsets, lengths and buffer addresses are multiples.
PAGE = 4096
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_SIZE = 256
_DIO_ALIGN_OFFSET = 152  # stx_dio_mem_align, stx_dio_offset_align (u32 each)


@dataclass(frozen=True)
class WriteMode:
    """How files on one filesystem are written.

    Attributes
    ----------
    mode : str
        ``"direct"`` (O_DIRECT from the pool) or ``"buffered"`` (through the page cache).
    reason : str
        Why, in words (for the log and ``ckptd status``).
    """

    mode: str
    reason: str

    @property
    def direct(self) -> bool:
        """Whether files are written with O_DIRECT."""
        return self.mode == "direct"


def _dio_alignment(fd: int) -> tuple[int, int] | None:
    """``(memory, offset)`` alignment the filesystem of ``fd`` reports for direct I/O:
    None where the kernel does not say (then only trying tells), (0, 0) where it refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buffer) != 0:
        return None
    if not struct.unpack_from("<I", buffer, 0)[0] & _STATX_DIOALIGN:
        return None
    return struct.unpack_from("<II", buffer, _DIO_ALIGN_OFFSET)


def _decide(fd: int) -> WriteMode:
    """The write mode of the filesystem of ``fd`` (a file opened for writing, or a
    directory); may set O_DIRECT on ``fd`` to try."""
    alignment = _dio_alignment(fd)
    if alignment is not None:
        memory, offset = alignment
        if not memory or not offset:
            return WriteMode("buffered", "the filesystem reports no direct I/O (statx)")
        if memory > PAGE or offset > PAGE:
            return WriteMode("buffered", f"direct I/O needs {offset}-byte offsets and "
                             f"{memory}-byte buffers, more than a {PAGE}-byte page (statx)")
        return WriteMode("direct", f"statx: {offset}-byte offsets, {memory}-byte buffers")
    return WriteMode("direct", "the filesystem accepts O_DIRECT (no statx DIO alignment)")


_modes: dict[int, WriteMode] = {}
_modes_lock = threading.Lock()


def write_mode_of(fd: int, where: str) -> WriteMode:
    """The write mode of the filesystem holding ``fd`` (a file just created for writing),
    decided and logged once per filesystem; sets ``O_DIRECT`` on ``fd`` when it is direct.

    Parameters
    ----------
    fd : int
        The new file.
    where : str
        Its path, for the one log line.
    """
    device = os.fstat(fd).st_dev
    with _modes_lock:
        known = _modes.get(device)
    mode = known or _decide(fd)
    if mode.direct:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        except OSError as exc:
            name = errno_mod.errorcode.get(exc.errno or 0, str(exc.errno))
            mode = WriteMode("buffered", f"the filesystem refuses O_DIRECT ({name})")
    if mode != known:
        with _modes_lock:
            _modes[device] = mode
        log.info("filesystem of %s (device %d:%d): files written %s, %s; buffered files "
                 "leave the page cache after their fsync", os.path.dirname(where),
                 os.major(device), os.minor(device), mode.mode, mode.reason)
    return mode


def probe_directory(directory: str) -> WriteMode:
    """The write mode files under ``directory`` get (for ``ckptd status``): creates and
    removes a hidden probe file there."""
    name = os.path.join(directory, f".ckptd-probe.{os.getpid()}.{os.urandom(4).hex()}.ckptd-tmp")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        return WriteMode("unknown", f"cannot create a file there: {exc.strerror}")
    try:
        os.unlink(name)
        return write_mode_of(fd, name)
    finally:
        os.close(fd)


def drop_cached_pages(fd: int) -> None:
    """Drop a durable file's pages from the page cache: nobody reads them back soon, and
    they would push out what the trainers use."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass  # advice only


def buffer_address(view: memoryview) -> int | None:
    """Where ``view``'s bytes are in memory, or None for a read-only buffer (never
    handed to the kernel directly: it may not be page-aligned or pinned for long)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_executor: ThreadPoolExecutor | None = None

# Bounce buffers of finished files, for the next file of this process: a fresh anonymous
# mapping costs a page fault and a zeroed page per 4 KiB when first written (several
# milliseconds of kernel time a file on these machines), where a reused one costs nothing.
# Only buffers no write uses any more are kept, at most a file's limit: the writes in
# flight plus one chunk's worth (37 MiB of a writer process with the default 32 MiB chunks
# and 1 MiB bounce buffers, for a file of many small records).
_spare_buffers: list[mmap.mmap] = []
_spare_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=max(1, knobs.DIRECT_WRITE_THREADS.get()),
                                       thread_name_prefix="ckptd-dio")
    return _executor


def _load_fallocate():
    try:
        function = ctypes.CDLL(None, use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    return function


# glibc's fallocate, not os.posix_fallocate: where a filesystem cannot allocate, the latter
# writes a zero into every block instead (with buffered 1-byte writes O_DIRECT refuses).
fallocate = _load_fallocate()


def allocating_ahead_pays(fd: int) -> bool:
    """Whether allocating a file's space before writing it is worth it on the filesystem of
    ``fd``: on a disk it only reserves extents, and keeps direct writes from extending the
    file one after the other under the inode's lock; tmpfs zeroes every page it allocates,
    which the write then copies over (a pass over the bytes for nothing), and takes that
    lock for every write anyway."""
    if fallocate is None:
        return False
    try:
        return statfs(fd)[0] != TMPFS_MAGIC
    except OSError:
        return True
_MAX_SEGMENTS = 512  # buffers per pwritev, well under the kernel's IOV_MAX (1024)


def _write_batch(fd: int, segments: list, offset: int, update) -> tuple:
    """Checksum each ``(view, checked)`` segment's first ``checked`` bytes and write them
    all, back to back, at ``offset`` (one ``pwritev`` for the lot, retried on a short one)."""
    crc, checked_total = 0, 0
    for view, checked in segments:
        crc = update(view[:checked], crc)
        checked_total += checked
    views = [view for view, _ in segments]
    done, total = 0, sum(view.nbytes for view in views)
    while done < total:
        written = os.pwritev(fd, views, offset + done)
        if not written:
            raise OSError(errno_mod.EIO, "pwritev returned no progress")
        done += written
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]
    return offset, checked_total, crc


class DirectFileWriter:
    """The stream of one file opened with ``O_DIRECT`` (see the module's docstring).

    Has the interface of :class:`ckptd.checksum.ChecksumWriter` that ckptd's serializers
    use (``write``, ``tell``, ``result``, ``error``) plus :meth:`finish`, which must run
    before the fsync, and :meth:`abort`, which waits for writes in flight.

    Parameters
    ----------
    fd : int
        The file, opened with ``O_DIRECT``, empty.
    algorithm : str
        The checksum algorithm of the record (``crc32c``, ``crc32``).
    """

    def __init__(self, fd: int, algorithm: str) -> None:
        self._fd = fd
        self._update = algorithm_named(algorithm).update
        self.algorithm = algorithm
        self.size = 0
        self.error: OSError | None = None
        #: ``progress(phase, bytes_done)`` after each write (set by DurableFile), or None.
        self.progress = None
        self._chunk = max(PAGE, knobs.DIRECT_CHUNK_BYTES.get() // PAGE * PAGE)
        self._bounce_size = max(PAGE, knobs.DIRECT_BOUNCE_BYTES.get() // PAGE * PAGE)
        self._in_flight_limit = max(2, 2 * knobs.DIRECT_WRITE_THREADS.get())
        # bounce buffers in flight, plus those gathered into the batch being built
        self._buffer_limit = self._in_flight_limit + self._chunk // self._bounce_size + 1
        self._bounce: mmap.mmap | None = None
        self._fill = 0          # bytes in the bounce buffer
        self._bounce_at = 0     # file offset of the bounce buffer's first byte
        self._spare: list[mmap.mmap] = []
        self._buffers = 0
        self._in_flight: deque[tuple[Future, list[mmap.mmap]]] = deque()
        # Consecutive pieces of the file gathered into one pwritev (one hand-over to a
        # thread, one system call) up to a chunk: a file of many records would otherwise
        # cost a thread wake-up per header and per tensor.
        self._batch: list[tuple[memoryview, int]] = []
        self._batch_buffers: list[mmap.mmap] = []
        self._batch_at = 0
        self._batch_bytes = 0
        self._pieces: list[tuple[int, int, int]] = []
        self._allocated = 0     # bytes of the file allocated ahead (0: allocation stopped)
        self._allocate_step = knobs.DIRECT_ALLOCATE_BYTES.get() // PAGE * PAGE
        self._allocating = self._allocate_step > 0 and allocating_ahead_pays(fd)
        self._direct_from = knobs.DIRECT_MIN_BYTES.get()  # read once: a file has thousands of writes

    def fileno(self) -> int:
        """The file descriptor written to."""
        return self._fd

    def tell(self) -> int:
        """Bytes written so far."""
        return self.size

    def write(self, data) -> int:
        """Write all of ``data``: straight from its buffer when it starts on a page of the
        file and of memory, else through the bounce buffer."""
        view = memoryview(data).cast("B")
        nbytes = view.nbytes
        body = nbytes - nbytes % PAGE
        if (body >= self._direct_from and self._fill % PAGE == 0
                and (buffer_address(view) or 1) % PAGE == 0):
            self._flush_bounce()
            for start in range(0, body, self._chunk):
                piece = view[start:min(start + self._chunk, body)]
                self._queue(self._bounce_at + start, piece, piece.nbytes, None)
            self._bounce_at += body
            view = view[body:]
        self._copy(view)
        self.size += nbytes
        if self.progress is not None:
            self.progress("write", self.size)
        return nbytes

    def _copy(self, view: memoryview) -> None:
        while view.nbytes:
            if self._bounce is None:
                self._bounce = self._take_buffer()
            count = min(view.nbytes, self._bounce_size - self._fill)
            self._bounce[self._fill:self._fill + count] = view[:count]
            self._fill += count
            view = view[count:]
            if self._fill == self._bounce_size:
                self._flush_bounce()

    def _flush_bounce(self, padded: int | None = None) -> None:
        if not self._fill:
            return
        length = padded or self._fill
        self._queue(self._bounce_at, memoryview(self._bounce)[:length], self._fill,
                     self._bounce)
        self._bounce_at += self._fill
        self._bounce, self._fill = None, 0

    def _take_buffer(self) -> mmap.mmap:
        while not self._spare and self._buffers >= self._buffer_limit:
            if self._in_flight:
                self._reap()
            else:
                self._send_batch()
        if self._spare:
            return self._spare.pop()
        self._buffers += 1
        with _spare_lock:
            if _spare_buffers and len(_spare_buffers[-1]) == self._bounce_size:
                return _spare_buffers.pop()
        return mmap.mmap(-1, self._bounce_size)  # page-aligned, as O_DIRECT needs

    def _give_back_buffers(self) -> None:
        """Every write has ended: this file's bounce buffers are free for the next file
        (as many as one file may use at most)."""
        with _spare_lock:
            if _spare_buffers and len(_spare_buffers[0]) != self._bounce_size:
                _spare_buffers.clear()  # the knob changed: all kept buffers have one size
            room = max(self._buffer_limit - len(_spare_buffers), 0)
            _spare_buffers.extend(self._spare[:room])
        self._spare = []

    def _allocate_to(self, end: int) -> None:
        """Allocate the file up to past ``end`` before a write reaches there (see the
        module's docstring); a filesystem that cannot (or is full) just gets no more: the
        write itself says ENOSPC if the space is really gone."""
        target = max(end, self._allocated + self._allocate_step)
        if fallocate(self._fd, 0, self._allocated, target - self._allocated) != 0:
            self._allocating = False
            return
        self._allocated = target

    def _queue(self, offset: int, view: memoryview, checked: int, buffer) -> None:
        """Add a piece (it starts where the batch ends) to the batch; send it when full."""
        if not self._batch:
            self._batch_at = offset
        self._batch.append((view, checked))
        if buffer is not None:
            self._batch_buffers.append(buffer)
        self._batch_bytes += view.nbytes
        if self._batch_bytes >= self._chunk or len(self._batch) >= _MAX_SEGMENTS:
            self._send_batch()

    def _send_batch(self) -> None:
        if not self._batch:
            return
        end = self._batch_at + self._batch_bytes
        if self._allocating and end > self._allocated:
            self._allocate_to(end)
        while len(self._in_flight) >= self._in_flight_limit:
            self._reap()
        future = _threads().submit(_write_batch, self._fd, self._batch, self._batch_at,
                                   self._update)
        self._in_flight.append((future, self._batch_buffers))
        self._batch, self._batch_buffers, self._batch_bytes = [], [], 0

    def _reap(self) -> None:
        future, buffers = self._in_flight.popleft()
        try:
            self._pieces.append(future.result())
        except OSError as exc:
            self.error = exc
            self.abort()
            raise
        finally:
            self._spare.extend(buffers)

    def finish(self) -> None:
        """Write what is left (the last page whole), wait for every write, and cut the
        file to its size (which also frees what was allocated ahead)."""
        if self._fill:
            padded = -(-self._fill // PAGE) * PAGE
            self._bounce[self._fill:padded] = bytes(padded - self._fill)
            self._flush_bounce(padded)
        self._send_batch()
        while self._in_flight:
            self._reap()
        self._give_back_buffers()
        if os.fstat(self._fd).st_size != self.size:
            os.ftruncate(self._fd, self.size)

    def abort(self) -> None:
        """Wait for the writes in flight (their buffers may be unmapped after)."""
        while self._in_flight:
            future, _ = self._in_flight.popleft()
            try:
                future.result()
            except OSError:
                pass

    def result(self) -> Checksum:
        """The checksum of everything written (after :meth:`finish`)."""
        return combine_pieces(self._pieces, self.algorithm) if self._pieces else \
            Checksum(0, 0, self.algorithm)
