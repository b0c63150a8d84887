"""Direct writes: file bytes go from the staging pool to the device, not via the page cache.

Owns :class:`DirectFileWriter`, the stream a direct file's bytes are written into
(:mod:`ckptd.storage.write_modes` decides whether a filesystem gets one). A write that
starts on a page boundary of the file, from a page-aligned buffer of the pool, goes to the
disk as it is, in large chunks written by a few threads (``pwritev`` releases the GIL);
everything else (zip headers, padding, small tensors, the unaligned tail of a large one)
is gathered in a small page-aligned bounce buffer written the same way. Consecutive
pieces (bounce buffers, tensors) are gathered into one ``pwritev`` of up to a chunk, so a
file of a thousand records costs about one hand-over to a thread per chunk, not one per
record; a batch goes out before it holds a chunk when none of the file's writes is in
flight (the disk would wait for it). Batches end where the file crosses a multiple of the
chunk (a tensor's bytes are cut there), not a chunk after wherever they began: the kernel
cuts each write into requests of the disk's largest size (4 MiB here) from the write's
start, so a write of 32 MiB and a bit cost a short request more, and on the virtio disks
here each request costs a fixed ~0.3 ms on top of its bytes (a 0.9 GiB torch file took
265 requests where the raw write of its bytes took 234; cut at the chunk's multiples,
246-254). A bounce buffer flushed before a tensor's own write
goes on being filled after it, from the next page: a file of a thousand tensors would
otherwise take a fresh buffer for each header of a few hundred bytes, run out of buffers
within a chunk and wait for the disk before it could gather the next one.

Each chunk is checksummed by a helper thread *while* the kernel writes it, not before: a
checksum ahead of its write kept the disk idle for its duration whenever one write at a
time was in flight (about 5 % of a file's time here). The bytes cannot change under
either: the staging extent is held by the daemon until this file's result, which comes
after both, and a bounce buffer is filled again only after both are done.

The file's last page is written whole and the file truncated to its size. Space is
allocated ahead of the writes (``fallocate``): a direct write past the end of a file takes
the inode's lock alone and waits for the disk under it, so the threads' writes would queue
one behind the other; into allocated space they run side by side (not on tmpfs:
:func:`allocating_ahead_pays`). As much as the caller knows the file will hold is
allocated at once, before the first write: ``fallocate`` waits for every direct write of
the file in flight (ext4 drains them under the inode's lock), so allocating step by step
as the writes went emptied the disk's queue once a chunk.

The file layouts cooperate: ckptd's torch files start every record's data on a 4 KiB
boundary (torch's ``storage_alignment``), a large DCP tensor item's bytes start on one
(:mod:`ckptd.storage.layout`), and the staging extent places large tensors on page
boundaries (``ckptd.protocol.layout_extent``), so large tensor bodies are never copied.
Pattern: aligned bounce buffer + chunked positional writes. No torch; no sockets.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_mod
import logging
import mmap
import os
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from ckptd import knobs
from ckptd.checksum import Checksum, algorithm_named, combine_pieces
from ckptd.filesystems import TMPFS_MAGIC, statfs

log = logging.getLogger(__name__)

__all__ = ["PAGE", "DirectFileWriter", "buffer_address", "fallocate", "allocating_ahead_pays"]

#: The unit of a direct write: file offsets, lengths and buffer addresses are multiples.
PAGE = 4096


def buffer_address(view: memoryview) -> int | None:
    """Where ``view``'s bytes are in memory, or None for a read-only buffer (never
    handed to the kernel directly: it may not be page-aligned or pinned for long)."""
    if view.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_executor: ThreadPoolExecutor | None = None
_checksummers: ThreadPoolExecutor | None = None

# Bounce buffers of finished files, for the next file of this process: a fresh anonymous
# mapping costs a page fault and a zeroed page per 4 KiB when first written (several
# milliseconds of kernel time a file on these machines), where a reused one costs nothing.
# Only buffers no write uses any more are kept, at most a file's limit: the writes in
# flight plus one chunk's worth (42 MiB of a writer process with the default 32 MiB chunks
# and 2 MiB bounce buffers, for a file of many small records).
_spare_buffers: list[mmap.mmap] = []
_spare_lock = threading.Lock()


def _threads() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The threads that write, and those that checksum what is being written."""
    global _executor, _checksummers
    if _executor is None:
        count = max(1, knobs.DIRECT_WRITE_THREADS.get())
        _executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="ckptd-dio")
        _checksummers = ThreadPoolExecutor(max_workers=count, thread_name_prefix="ckptd-dio-crc")
    return _executor, _checksummers


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


def _new_bounce_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer (as O_DIRECT needs) for bounce copies: private anonymous
    memory on huge pages where the kernel gives them (a buffer of whole 2 MiB pages, and
    transparent huge pages ``madvise`` or ``always``). A disk request holds at most
    ``max_segments`` runs of contiguous memory (254 here): from scattered 4 KiB pages, as
    ``mmap(-1)``'s shared memory is where shmem_enabled is never, each 1 MiB of a bounce
    buffer took two requests (1016 KiB and 8 KiB), a file's many small records a few dozen
    short requests more than the raw write of its bytes."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages, still right
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def _checksum_batch(segments: list, offset: int, update) -> tuple:
    """``(offset, bytes, crc)`` of each ``(view, checked)`` segment's first ``checked``
    bytes, back to back (the padding of a file's last page is not the file's)."""
    crc, checked_total = 0, 0
    for view, checked in segments:
        crc = update(view[:checked], crc)
        checked_total += checked
    return offset, checked_total, crc


def _write_batch(fd: int, views: list, offset: int) -> None:
    """Write ``views`` back to back at ``offset`` (one ``pwritev`` for the lot, retried
    on a short one)."""
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
    size_hint : int
        Bytes the file will hold at least (allocated before the first write; 0: unknown).
        No more than it will hold, as far as the caller knows: what is allocated past its
        end is taken from every other file on the filesystem until it is cut to size.
    """

    def __init__(self, fd: int, algorithm: str, size_hint: int = 0) -> None:
        self._fd = fd
        self._update = algorithm_named(algorithm).update
        self.algorithm = algorithm
        self.size = 0
        self.error: OSError | None = None
        #: ``progress(phase, bytes_done)`` after each write (set by DurableFile), or None.
        self.progress = None
        self._chunk = max(PAGE, knobs.DIRECT_CHUNK_BYTES.get() // PAGE * PAGE)
        self._bounce_size = max(PAGE, knobs.DIRECT_BOUNCE_BYTES.get() // PAGE * PAGE)
        self._idle_batch = max(PAGE, knobs.DIRECT_IDLE_BATCH_BYTES.get())
        self._in_flight_limit = max(2, 2 * knobs.DIRECT_WRITE_THREADS.get())
        # bounce buffers in flight, plus those gathered into the batch being built
        self._buffer_limit = self._in_flight_limit + self._chunk // self._bounce_size + 1
        self._bounce: mmap.mmap | None = None
        self._base = 0          # where in the bounce buffer its unwritten region starts
        self._fill = 0          # bytes in that region
        self._bounce_at = 0     # file offset of the region's first byte
        self._spare: list[mmap.mmap] = []
        self._buffers = 0
        # regions of each bounce buffer queued and not yet written (id -> count): a buffer
        # goes back to the spares when it is full or the file done and its count is 0
        self._uses: dict[int, int] = {}
        self._in_flight: deque[tuple[Future, Future, list[mmap.mmap]]] = deque()
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
        self.reserve(size_hint)
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
            at, start = self._bounce_at, 0
            while start < body:  # cut where the file crosses a multiple of the chunk
                end = min(body, (at + start) // self._chunk * self._chunk + self._chunk - at)
                piece = view[start:end]
                self._queue(at + start, piece, piece.nbytes, None)
                start = end
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
                self._bounce, self._base = self._take_buffer(), 0
            at = self._base + self._fill
            count = min(view.nbytes, self._bounce_size - at)
            self._bounce[at:at + count] = view[:count]
            self._fill += count
            view = view[count:]
            if at + count == self._bounce_size:
                self._flush_bounce()

    def _flush_bounce(self, padded: int | None = None) -> None:
        """Queue the bounce buffer's region. The buffer's next region starts right after it
        (on a page: a region flushed before a direct write ends on one) while a page is
        left; a full buffer, or the file's padded last page, leaves the buffer, which goes
        back to the spares once its regions are written."""
        if not self._fill:
            return
        buffer, start, filled = self._bounce, self._base, self._fill
        length = padded or filled
        at = self._bounce_at
        self._bounce_at += filled
        self._base, self._fill = start + length, 0
        if padded or self._base % PAGE or self._base + PAGE > self._bounce_size:
            self._bounce, self._base = None, 0
        self._queue(at, memoryview(buffer)[start:start + length], filled, buffer)

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
        return _new_bounce_buffer(self._bounce_size)

    def _give_back_buffers(self) -> None:
        """Every write has ended: this file's bounce buffers are free for the next file
        (as many as one file may use at most)."""
        with _spare_lock:
            if _spare_buffers and len(_spare_buffers[0]) != self._bounce_size:
                _spare_buffers.clear()  # the knob changed: all kept buffers have one size
            room = max(self._buffer_limit - len(_spare_buffers), 0)
            _spare_buffers.extend(self._spare[:room])
        self._spare = []

    def reserve(self, size: int) -> None:
        """The file will hold ``size`` bytes: allocate up to there now, before the first
        write (a file made before its size was known got a guess; too much is cut by
        :meth:`finish`). Whole pages: the last one is written padded, and allocating its
        tail later would wait for every write in flight (what allocating up front avoids)."""
        ahead = -(-size // PAGE) * PAGE
        if self._allocating and ahead > self._allocated:
            if fallocate(self._fd, 0, self._allocated, ahead - self._allocated) == 0:
                self._allocated = ahead
            else:
                self._allocating = False

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
            self._uses[id(buffer)] = self._uses.get(id(buffer), 0) + 1
        self._batch_bytes += view.nbytes
        end = self._batch_at + self._batch_bytes
        if (end // self._chunk > self._batch_at // self._chunk or len(self._batch) >= _MAX_SEGMENTS
                or (self._batch_bytes >= self._idle_batch and self._disk_idle())):
            self._send_batch()

    def _disk_idle(self) -> bool:
        """Whether none of this file's writes is in flight (then a batch goes out before
        it holds a chunk: the disk would wait for it otherwise)."""
        return all(written.done() for written, _, _ in self._in_flight)

    def _send_batch(self) -> None:
        if not self._batch:
            return
        end = self._batch_at + self._batch_bytes
        if self._allocating and end > self._allocated:
            self._allocate_to(end)
        while len(self._in_flight) >= self._in_flight_limit:
            self._reap()
        writers, checksummers = _threads()
        views = [view for view, _ in self._batch]
        written = writers.submit(_write_batch, self._fd, views, self._batch_at)
        summed = checksummers.submit(_checksum_batch, self._batch, self._batch_at, self._update)
        self._in_flight.append((written, summed, self._batch_buffers))
        self._batch, self._batch_buffers, self._batch_bytes = [], [], 0

    def _reap(self) -> None:
        written, summed, buffers = self._in_flight.popleft()
        try:
            written.result()
            self._pieces.append(summed.result())
        except OSError as exc:
            self.error = exc
            summed.exception()  # its bytes stay put until it is done
            self.abort()
            raise
        finally:
            self._release(buffers)

    def _release(self, buffers: list[mmap.mmap]) -> None:
        """A batch's regions are written: spare the buffers none of whose regions is
        pending any more, unless still being filled."""
        for buffer in buffers:
            left = self._uses[id(buffer)] - 1
            if left:
                self._uses[id(buffer)] = left
                continue
            del self._uses[id(buffer)]
            if buffer is not self._bounce:
                self._spare.append(buffer)

    def finish(self) -> None:
        """Write what is left (the last page whole), wait for every write, and cut the
        file to its size (which also frees what was allocated ahead)."""
        if self._fill:
            padded = -(-self._fill // PAGE) * PAGE
            self._bounce[self._base + self._fill:self._base + padded] = bytes(padded - self._fill)
            self._flush_bounce(padded)
        self._send_batch()
        while self._in_flight:
            self._reap()
        if self._bounce is not None:  # left with room after a tensor that ended the file
            self._spare.append(self._bounce)
            self._bounce, self._base = None, 0
        self._give_back_buffers()
        if os.fstat(self._fd).st_size != self.size:
            os.ftruncate(self._fd, self.size)

    def abort(self) -> None:
        """Wait for the writes and checksums in flight (their buffers may be unmapped or
        the extent reused after)."""
        while self._in_flight:
            written, summed, _ = self._in_flight.popleft()
            written.exception()
            summed.exception()

    def result(self) -> Checksum:
        """The checksum of everything written (after :meth:`finish`)."""
        return combine_pieces(self._pieces, self.algorithm) if self._pieces else \
            Checksum(0, 0, self.algorithm)
