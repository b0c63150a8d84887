"""The staging pool: one shared-memory segment, allocated once, carved into extents.

Owns the segment's life (create it through :mod:`ckptd.staging.segment`, page-lock when a
GPU is present, unlink) and the extent allocator with back-pressure: a request that does
not fit *now* waits in FIFO order until writers release space; a request larger than the
whole pool is refused at once. An extent is released only through its lease
(``ckptd.server.lifecycle``) once every reader (device copy, writers, replicas) dropped
its hold, so staged bytes are never overwritten.

Pattern: first-fit free list over one mapping; clients map the same file by path (the one
the daemon announces; the directory is ``--pool-dir``, checked by
:mod:`ckptd.staging.pool_directory`, on huge pages where its mount gives them). On a
machine with several NUMA nodes the segment is cut into one region per node, each bound to
its node before its pages exist; an allocation names the node it is ``near`` and gets an
extent in that region when one fits, else anywhere (a remote node is slower, waiting is
worse). It must not know about requests, files or sockets.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import secrets
from collections import deque
from dataclasses import dataclass, field

from ckptd import knobs
from ckptd.aligned_mapping import retire_mapping
from ckptd.protocol import EXTENT_ALIGNMENT, align_up, process_alive
from ckptd.staging import segment
from ckptd.staging.pool_directory import (HUGE_PAGE_ADVICE, PoolDirectory, check_pool_directory,
                                          huge_page_bytes)
from ckptd.staging.segment import Region

__all__ = ["Extent", "PoolTooSmallError", "Region", "StagingPool", "pool_path_for_this_daemon",
           "remove_stale_pools"]

log = logging.getLogger(__name__)


def remove_stale_pools(directory: str | None = None) -> tuple[list[str], list[int]]:
    """Unlink pools of this user whose daemon no longer runs (it was SIGKILLed).

    Parameters
    ----------
    directory : str, optional
        Where pools are made (default: the ``CKPTD_POOL_DIR`` knob).

    Returns
    -------
    (list of str, list of int)
        The paths removed, and the pids of other daemons whose pools stay because they
        still run (a daemon of another job, or one killed a moment ago and still exiting:
        sweep again later).
    """
    directory = directory or knobs.POOL_DIR.get()
    prefix = f"ckptd-{os.getuid()}-"
    removed, running = [], []
    for name in os.listdir(directory):
        parts = name.split("-")
        if not name.startswith(prefix) or len(parts) != 4 or not parts[2].isdigit():
            continue
        pid, path = int(parts[2]), os.path.join(directory, name)
        if process_alive(pid):
            if pid != os.getpid():
                running.append(pid)
            continue
        outcome = _unlink_unless_held(path)
        if outcome == "removed":
            removed.append(path)
        elif outcome == "held":  # by a daemon whose pid we cannot see: look again later
            running.append(pid)
    if removed:
        log.info("removed %d staging pool(s) left by dead daemons: %s", len(removed), ", ".join(removed))
    return removed, running


def _unlink_unless_held(path: str) -> str | None:
    """Unlink the pool file ``path`` unless a live daemon holds its lock (one in another pid
    namespace, whose pid looked dead here): ``"removed"``, ``"held"``, or ``None`` when it
    is not a regular file of this user (a name planted by someone else in a shared
    directory is left alone) or is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:  # gone, a symlink, or not ours to open
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "held"
        os.unlink(path)
        return "removed"
    except OSError:
        return None
    finally:
        os.close(fd)


def pool_path_for_this_daemon(directory: str | None = None) -> str:
    """A fresh pool path: ``ckptd-<uid>-<pid>-<token>``, so leftovers can be attributed
    (in ``directory``, default the ``CKPTD_POOL_DIR`` knob)."""
    directory = directory or knobs.POOL_DIR.get()
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
    near: int | None = None


@dataclass
class StagingPool:
    """A fixed-size shared-memory segment with an extent allocator.

    Parameters
    ----------
    path : str
        File to create (must not exist) in a tmpfs or hugetlbfs directory.
    size : int
        Bytes to reserve; rounded up to :data:`EXTENT_ALIGNMENT` (to the huge page size on
        hugetlbfs).
    nodes : list of int, optional
        NUMA nodes to give a region each (two or more); ``None``: one unbound region.

    Raises
    ------
    PoolDirectoryError
        If ``path``'s directory is not a tmpfs or hugetlbfs directory.
    OSError
        If the pool does not fit (the message says what to lower or free).
    """

    path: str
    size: int
    nodes: list | None = None
    regions: list = field(default_factory=list)
    directory: PoolDirectory | None = None
    huge_page_bytes: int = 0  # of the pool, right after allocation
    _free: list = field(default_factory=list)
    _waiters: deque = field(default_factory=deque)
    _map: memoryview | None = None  # the mapping's bytes (segment.create): no descriptor
    _lock_fd: int | None = None  # the file's descriptor, holding its flock while we live
    registered_with_cuda: bool = False
    _registered: list = field(default_factory=list)  # page-locked chunk addresses

    def __post_init__(self) -> None:
        self.directory = check_pool_directory(os.path.dirname(self.path))
        self.size = align_up(self.size, max(EXTENT_ALIGNMENT, self.directory.page_size))
        self._map, self.regions, self._lock_fd, folded = segment.create(
            self.path, self.size, self.directory, self.nodes)
        self._free = [Extent(0, self.size)]
        self.huge_page_bytes = max(huge_page_bytes(segment.address(self._map)), folded)
        self._log_pages()

    def _log_pages(self) -> None:
        where = self.directory
        mount = where.filesystem if where.filesystem == "hugetlbfs" else f"tmpfs huge={where.huge}"
        log.info("staging pool %d MiB at %s (%s): %d MiB on huge pages", self.size >> 20,
                 self.path, mount, self.huge_page_bytes >> 20)
        if self.huge_page_bytes == 0:
            log.info("staging pool on 4 KiB pages: %s", HUGE_PAGE_ADVICE)

    def describe(self) -> dict:
        """The ``pool`` section of the status document."""
        return {"path": self.path, "size_bytes": self.size, "used_bytes": self.used_bytes,
                "free_bytes": self.free_bytes, "waiting_requests": self.waiting,
                "pinned": self.registered_with_cuda,
                "numa_nodes": [r.node for r in self.regions],
                "directory": self.directory.path, "filesystem": self.directory.filesystem,
                "huge": self.directory.huge, "huge_page_bytes": self.huge_page_bytes}

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

    def try_allocate(self, length: int, near: int | None = None) -> Extent | None:
        """Carve an extent of ``length`` bytes (in node ``near``'s region when one fits
        there), or ``None`` if it must wait.

        Raises
        ------
        PoolTooSmallError
            If ``length`` exceeds the pool size.
        """
        length = align_up(max(length, 1), EXTENT_ALIGNMENT)
        if length > self.size:
            raise PoolTooSmallError(
                f"request needs {length} bytes of staging space but the pool holds "
                f"{self.size}; start ckptd with a larger --pool-size (CKPTD_POOL_SIZE for a "
                "daemon that ckpt_client starts by itself)")
        if self._waiters:  # FIFO: nobody overtakes a request already waiting
            return None
        return self._carve(length, near)

    def _carve(self, length: int, near: int | None = None) -> Extent | None:
        for region in (r for r in self.regions if r.node == near):
            for i, hole in enumerate(self._free):
                start = max(hole.offset, region.start)
                if start + length <= min(hole.offset + hole.length, region.end):
                    return self._take(i, start, length)
        for i, hole in enumerate(self._free):
            if hole.length >= length:
                return self._take(i, hole.offset, length)
        return None

    def _take(self, index: int, start: int, length: int) -> Extent:
        hole = self._free[index]
        before = Extent(hole.offset, start - hole.offset)
        after = Extent(start + length, hole.offset + hole.length - start - length)
        self._free[index:index + 1] = [e for e in (before, after) if e.length]
        return Extent(start, length)

    def node_of(self, extent: Extent) -> int | None:
        """The NUMA node an extent's pages are bound to (``None``: unbound pool)."""
        return next((r.node for r in self.regions if r.start <= extent.offset < r.end), None)

    def wait_for(self, length: int, token: object, near: int | None = None) -> None:
        """Queue ``token`` until ``length`` bytes can be carved (see :meth:`release`)."""
        self._waiters.append(_Waiter(align_up(max(length, 1), EXTENT_ALIGNMENT), token, near))

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
            head = self._waiters[0]
            extent_for_head = self._carve(head.length, head.near)
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
        import time

        import torch

        address = segment.address(self._map)
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
        """Unlink the segment, take its pages out of this process (the range itself is
        unmapped with its last view) and release its lock: the file's pages are freed."""
        self.unregister_from_cuda()
        if self._map is not None:
            # Never unmapped here: the CUDA stager's tensor views the pool, and a worker that
            # outlived its join may still copy into it. Anonymous memory in its place takes
            # the writes instead; the mapping held the file, our descriptor below the rest.
            error = retire_mapping(segment.address(self._map), self.size)
            if error:  # the pages stay mapped until the last view (the process) is gone
                log.warning("the staging pool %s stays mapped: replacing it failed: %s",
                            self.path, os.strerror(error))
            self._map = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

