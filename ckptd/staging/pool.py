"""The staging pool: one shared-memory segment, allocated once, carved into extents.

Owns the segment's life (create, pre-fault, page-lock when a GPU is present, unlink) and
the extent allocator with back-pressure: a request that does not fit *now* waits in FIFO
order until writers release space; a request larger than the whole pool is refused at
once. An extent is released only through its lease (``ckptd.server.lifecycle``) once every
reader (device copy, writers, replicas) dropped its hold, so staged bytes are never
overwritten.

Pattern: first-fit free list over one ``mmap``; clients map the same file by path.
It must not know about requests, files or sockets.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
from collections import deque
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.protocol import EXTENT_ALIGNMENT, align_up, process_alive

log = logging.getLogger(__name__)


SHM_DIR = "/dev/shm"


def remove_stale_pools(directory: str = SHM_DIR) -> list[str]:
    """Unlink pools of this user whose daemon no longer runs (it was SIGKILLed).

    Returns
    -------
    list of str
        The paths removed.
    """
    prefix = f"ckptd-{os.getuid()}-"
    removed = []
    for name in os.listdir(directory):
        parts = name.split("-")
        if not name.startswith(prefix) or len(parts) != 4 or not parts[2].isdigit():
            continue
        if process_alive(int(parts[2])):
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d staging pool(s) left by dead daemons: %s", len(removed), ", ".join(removed))
    return removed


def pool_path_for_this_daemon(directory: str = SHM_DIR) -> str:
    """A fresh pool path: ``ckptd-<uid>-<pid>-<token>``, so leftovers can be attributed."""
    return os.path.join(directory, f"ckptd-{os.getuid()}-{os.getpid()}-{secrets.token_hex(4)}")


class PoolTooSmallError(Exception):
    """A single request needs more bytes than the whole pool holds."""


@dataclass(frozen=True)
class Extent:
    """A byte range ``[offset, offset + length)`` of the pool."""

    offset: int
    length: int


@dataclass
class _Waiter:
    length: int
    token: object


@dataclass
class StagingPool:
    """A fixed-size shared-memory segment with an extent allocator.

    Parameters
    ----------
    path : str
        File to create under ``/dev/shm`` (must not exist).
    size : int
        Bytes to reserve; rounded up to :data:`EXTENT_ALIGNMENT`.
    """

    path: str
    size: int
    _free: list = field(default_factory=list)
    _waiters: deque = field(default_factory=deque)
    _map: mmap.mmap | None = None
    registered_with_cuda: bool = False
    _registered: list = field(default_factory=list)  # page-locked chunk addresses

    def __post_init__(self) -> None:
        self.size = align_up(self.size, EXTENT_ALIGNMENT)
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                # Reserve every page now: a full /dev/shm fails here with a clear error
                # instead of a SIGBUS in the middle of a save.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                os.unlink(self.path)
                raise OSError(exc.errno, f"cannot reserve a {self.size}-byte staging pool at "
                              f"{self.path}: {exc.strerror}; lower --pool-size or free /dev/shm")
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self._free = [Extent(0, self.size)]

    # ------------------------------------------------------------------ allocation
    @property
    def free_bytes(self) -> int:
        """Bytes not held by any extent."""
        return sum(e.length for e in self._free)

    @property
    def used_bytes(self) -> int:
        """Bytes held by live extents."""
        return self.size - self.free_bytes

    @property
    def waiting(self) -> int:
        """Requests queued for space."""
        return len(self._waiters)

    def try_allocate(self, length: int) -> Extent | None:
        """Carve an extent of ``length`` bytes, or ``None`` if it must wait.

        Raises
        ------
        PoolTooSmallError
            If ``length`` exceeds the pool size.
        """
        length = align_up(max(length, 1), EXTENT_ALIGNMENT)
        if length > self.size:
            raise PoolTooSmallError(
                f"request needs {length} bytes of staging space but the pool holds "
                f"{self.size}; start ckptd with a larger --pool-size")
        if self._waiters:  # FIFO: nobody overtakes a request already waiting
            return None
        return self._carve(length)

    def _carve(self, length: int) -> Extent | None:
        for i, hole in enumerate(self._free):
            if hole.length >= length:
                rest = Extent(hole.offset + length, hole.length - length)
                self._free[i:i + 1] = [rest] if rest.length else []
                return Extent(hole.offset, length)
        return None

    def wait_for(self, length: int, token: object) -> None:
        """Queue ``token`` until ``length`` bytes can be carved (see :meth:`release`)."""
        self._waiters.append(_Waiter(align_up(max(length, 1), EXTENT_ALIGNMENT), token))

    def cancel_wait(self, token: object) -> list[tuple[object, Extent]]:
        """Forget a queued waiter (its owner went away).

        Returns
        -------
        list of (token, Extent)
            Waiters behind it that fit now that it no longer blocks the queue.
        """
        self._waiters = deque(w for w in self._waiters if w.token is not token)
        return self._grant_waiters()

    def release(self, extent: Extent) -> list[tuple[object, Extent]]:
        """Return ``extent`` to the free list; hand space to waiters in FIFO order.

        Returns
        -------
        list of (token, Extent)
            Waiters that now have their extent.
        """
        self._free.append(extent)
        self._free.sort(key=lambda e: e.offset)
        merged: list[Extent] = []
        for hole in self._free:
            if merged and merged[-1].offset + merged[-1].length == hole.offset:
                last = merged.pop()
                hole = Extent(last.offset, last.length + hole.length)
            merged.append(hole)
        self._free = merged
        return self._grant_waiters()

    def _grant_waiters(self) -> list[tuple[object, Extent]]:
        granted = []
        while self._waiters:
            extent_for_head = self._carve(self._waiters[0].length)
            if extent_for_head is None:
                break
            granted.append((self._waiters.popleft().token, extent_for_head))
        return granted

    # ------------------------------------------------------------------ memory
    def view(self, extent: Extent) -> memoryview:
        """A writable view of an extent (for the daemon's own staging copies)."""
        assert self._map is not None
        return memoryview(self._map)[extent.offset:extent.offset + extent.length]

    def register_with_cuda(self) -> None:
        """Page-lock the pool so device-to-host copies run at full speed.

        Registered in chunks of :data:`ckptd.knobs.CUDA_REGISTER_CHUNK_BYTES` (single
        registrations of hundreds of GiB fail on recent drivers); a failure clears CUDA's
        sticky error and leaves the pool pageable (slower copies, still correct).
        """
        import ctypes
        import time

        import torch

        buf = (ctypes.c_char * self.size).from_buffer(self._map)
        address = ctypes.addressof(buf)
        del buf
        cudart, chunk = torch.cuda.cudart(), knobs.CUDA_REGISTER_CHUNK_BYTES.get()
        started, registered = time.monotonic(), []
        for start in range(0, self.size, chunk):
            length = min(chunk, self.size - start)
            status = cudart.cudaHostRegister(address + start, length, 0)
            if int(status) != 0:
                cudart.cudaGetLastError()  # clear it, or the next CUDA call reports it
                for done, _ in registered:
                    cudart.cudaHostUnregister(done)
                log.warning("cudaHostRegister of the staging pool failed at byte %d (status %s); "
                            "device-to-host copies will be slower", start, status)
                return
            registered.append((address + start, length))
        self._registered = [a for a, _ in registered]
        self.registered_with_cuda = True
        seconds = time.monotonic() - started
        log.info("staging pool page-locked in %.2fs (%.2f s/GiB)", seconds,
                 seconds / max(self.size / (1 << 30), 1e-9))

    def unregister_from_cuda(self) -> None:
        """Undo :meth:`register_with_cuda` (at shutdown)."""
        if not self.registered_with_cuda:
            return
        import torch

        cudart = torch.cuda.cudart()
        for address in self._registered:
            cudart.cudaHostUnregister(address)
        self.registered_with_cuda = False

    def close(self) -> None:
        """Unmap and unlink the segment."""
        self.unregister_from_cuda()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view is still exported; the unlink below still frees it
                pass
            self._map = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
