"""Moving a part's bytes into the memory its tensors will live in, checksummed on the way.

Owns the two ways bytes arrive, and nothing about what they mean:

- :func:`read_file_into`: positional reads of a file straight into the destination, in
  large pieces (:data:`ckptd.knobs.LOAD_READ_BYTES`), with ``O_DIRECT`` where the
  filesystem takes it (decided once per filesystem and logged, like the writers' mode;
  :data:`ckptd.knobs.LOAD_READ_MODE` ``buffered`` turns it off), else through the page
  cache;
- :func:`copy_into`: a copy out of the daemon's staging pool (the memory tier), in
  cache-sized pieces (:data:`ckptd.knobs.LOAD_COPY_BYTES`), each checksummed right after
  its copy while it is still in the CPU's cache.

Either way the range is cut into one contiguous share per thread of a pool kept for the
process (reads, ``memmove`` through ctypes and the CRCs all release the GIL), each share
checksummed by its thread in the algorithm of the part's record, and the shares' CRCs
folded in order (:func:`ckptd.checksum.crc32_combine`). Pattern: aligned destination +
chunked positional I/O, checksum in the same pass. No torch.
"""

from __future__ import annotations

import ctypes
import errno as errno_mod
import fcntl
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from ckptd import knobs
from ckptd.checksum import Checksum, algorithm_named, crc32_combine

log = logging.getLogger(__name__)

__all__ = ["PAGE", "aligned_start", "direct_reads_for", "read_file_into", "copy_into"]

#: Offsets, lengths and buffer addresses of direct reads are multiples of this.
PAGE = 4096

_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()
_modes: dict[int, bool] = {}  # st_dev -> whether direct reads work there
_modes_lock = threading.Lock()


def _thread_count() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(knobs.LOAD_THREADS.get(), cpus))


def _pool() -> ThreadPoolExecutor:
    """The process's load threads: started once, not per load (starting threads costs
    milliseconds on a busy machine)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=max(1, knobs.LOAD_THREADS.get()),
                                           thread_name_prefix="ckpt-load")
        return _executor


def aligned_start(address: int, alignment: int = PAGE) -> int:
    """Bytes to skip from ``address`` to the next multiple of ``alignment``."""
    return -address % alignment


def _shares(total: int, work) -> list[tuple[int, int]]:
    """Run ``work(start, end) -> (crc, length)`` over ``[0, total)`` in one page-aligned
    share per thread; the shares' CRCs folded in order."""
    count = _thread_count()
    step = max(PAGE, -(-total // count // PAGE) * PAGE)
    bounds = [(start, min(start + step, total)) for start in range(0, total, step)]
    if len(bounds) <= 1:
        return [work(*b) for b in bounds]
    return list(_pool().map(lambda b: work(*b), bounds))


def _fold(pieces: list, algorithm: str, first: tuple[int, int] = (0, 0)) -> Checksum:
    crc, size = first
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length, algorithm)
        size += length
    return Checksum(crc, size, algorithm)


def direct_reads_for(fd: int, where: str) -> bool:
    """Whether ``fd``'s filesystem takes O_DIRECT reads (decided and logged once per
    filesystem; sets ``O_DIRECT`` on ``fd`` when it does)."""
    if knobs.LOAD_READ_MODE.get() != "direct":
        return False
    device = os.fstat(fd).st_dev
    with _modes_lock:
        known = _modes.get(device)
    if known is False:
        return False
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        works, why = True, "O_DIRECT"
    except OSError as exc:
        name = errno_mod.errorcode.get(exc.errno or 0, str(exc.errno))
        works, why = False, f"the filesystem refuses O_DIRECT ({name})"
    if known is None:
        _remember(device, works, where, why)
    return works


def _remember(device: int, works: bool, where: str, why: str) -> None:
    with _modes_lock:
        _modes[device] = works
    log.info("filesystem of %s (device %d:%d): local parts are read %s (%s)",
             os.path.dirname(where), os.major(device), os.minor(device),
             "direct" if works else "through the page cache", why)


def read_file_into(fd: int, view: memoryview, size: int, algorithm: str | None,
                   direct: bool, where: str) -> Checksum | None:
    """Read bytes ``[0, size)`` of ``fd`` into ``view`` (``view[0]`` is file offset 0).

    With ``direct``, ``view`` must start on a page and hold ``size`` rounded up to a page
    (the last read is a whole page). A direct read the filesystem refuses (EINVAL) is
    done again through the page cache, and the filesystem remembered as buffered.

    Returns
    -------
    Checksum or None
        Of the ``size`` bytes in ``algorithm`` (None when ``algorithm`` is None).

    Raises
    ------
    ValueError
        If the file ends before ``size`` bytes.
    """
    update = algorithm_named(algorithm).update if algorithm else None
    chunk = max(PAGE, knobs.LOAD_READ_BYTES.get() // PAGE * PAGE)

    def share(start: int, end: int) -> tuple[int, int]:
        crc = 0
        for piece in range(start, end, chunk):
            stop = min(piece + chunk, end)
            done, want = piece, (-(-stop // PAGE) * PAGE if direct else stop)
            while done < stop:
                got = os.preadv(fd, [view[done:want]], done)
                if got <= 0:
                    raise ValueError(f"{where} is truncated at byte {done} (expected {size})")
                done += got
            if update is not None:
                crc = update(view[piece:stop], crc)
        return crc, end - start

    try:
        pieces = _shares(size, share)
    except OSError as exc:
        if not direct or exc.errno != errno_mod.EINVAL:
            raise
        _remember(os.fstat(fd).st_dev, False, where, "a direct read was refused (EINVAL)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        return read_file_into(fd, view, size, algorithm, False, where)
    return _fold(pieces, algorithm) if algorithm else None


def copy_into(destination: int, source: int, view: memoryview, size: int,
              algorithm: str | None) -> Checksum | None:
    """Copy ``size`` bytes from address ``source`` to address ``destination`` (``view``:
    the destination's bytes), checksumming each piece right after its copy.

    Returns
    -------
    Checksum or None
        Of the ``size`` bytes copied, in ``algorithm`` (None when ``algorithm`` is None).
    """
    update = algorithm_named(algorithm).update if algorithm else None
    chunk = max(PAGE, knobs.LOAD_COPY_BYTES.get())

    def share(start: int, end: int) -> tuple[int, int]:
        crc = 0
        for piece in range(start, end, chunk):
            stop = min(piece + chunk, end)
            ctypes.memmove(destination + piece, source + piece, stop - piece)
            if update is not None:
                crc = update(view[piece:stop], crc)
        return crc, end - start

    pieces = _shares(size, share)
    return _fold(pieces, algorithm) if algorithm else None
