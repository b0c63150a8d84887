"""The save methods the benchmark compares, behind one small interface.

Each method has ``start(path)`` (the call the trainer waits for), ``before_update()``
(what the trainer waits for right before its next optimizer step: staging of a
zero-stall save, torchtitan's ``staging_completion``; nothing for the others) and
``wait_durable()`` (returns once the checkpoint is on disk: files fsynced and, for
formats with one, committed). Lower bounds (memcpy, raw disk) and synchronous saves do
all their work in ``start``.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import shutil
from typing import Callable

import torch

CHUNK = 32 << 20          # raw-disk write size
ALIGN = 64                # tensor alignment in the staging buffer (as ckptd's pool)
PAGE = 4096


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Offsets of ``tensors`` packed back to back at 64-byte alignment, and the total."""
    offsets, at = [], 0
    for t in tensors:
        offsets.append(at)
        at = _align(at + t.nbytes, ALIGN)
    return offsets, _align(max(at, 1), PAGE)


def fsync_path(path: str) -> None:
    """fsync a file or directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Method:
    """One way of saving the state dict."""

    name = "?"
    #: "bound" (lower bound / disk limit), "sync" (blocks until durable) or "async".
    kind = "sync"
    #: Whether ``start`` writes a checkpoint under ``path``.
    writes = True

    def prepare(self) -> None:
        """One-time set-up outside any timing."""

    def start(self, path: str) -> None:
        """Do the blocking part of a save into ``path``."""
        raise NotImplementedError

    def before_update(self) -> None:
        """Wait for what must finish before parameters change (the optimizer guard)."""

    def wait_durable(self) -> None:
        """Block until the save begun by :meth:`start` is durable."""

    def helper_pids(self) -> list[int]:
        """Processes other than the trainer that do this method's work."""
        return []

    def close(self) -> None:
        """Release what :meth:`prepare` set up."""


# ---------------------------------------------------------------- lower bounds

class PreallocatedCopy(Method):
    """memcpy of every tensor into a pre-faulted shared-memory buffer (ckptd's pool layout).

    On CUDA, the buffer is page-locked and the copy is a device-to-host copy.

    With ``one_call`` the destination views are made once (in :meth:`prepare`) and a CPU
    copy is one ``torch._foreach_copy_`` over every tensor: the bytes moved and nothing
    else, the strictest bound torch offers. Without it each tensor is sliced, viewed and
    copied in a Python loop (what a hand-written staging loop does: a few µs a tensor
    more).
    """

    kind = "bound"
    writes = False

    def __init__(self, tensors: list[torch.Tensor], shm_dir: str = "/dev/shm",
                 one_call: bool = False) -> None:
        self.tensors = tensors
        self.offsets, self.size = layout(tensors)
        self.cuda = any(t.is_cuda for t in tensors)
        self.one_call = one_call
        self.name = "pinned D2H copy (preallocated)" if self.cuda else "memcpy (preallocated)"
        self.shm_path = os.path.join(shm_dir, f"bench-ckpt-{os.getpid()}")
        self.buffer: torch.Tensor | None = None
        self._map: mmap.mmap | None = None
        self._views: list[torch.Tensor] = []

    def prepare(self) -> None:
        fd = os.open(self.shm_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.size)
            self._map = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        self.buffer.fill_(0)
        if self.cuda:
            status = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.size, 0)
            if int(status) != 0:
                raise RuntimeError(f"cudaHostRegister failed with status {status}")
        if self.one_call:
            self._views = [self.buffer[o:o + t.nbytes].view(t.dtype).view(t.shape)
                           for o, t in zip(self.offsets, self.tensors)]

    def start(self, path: str) -> None:
        assert self.buffer is not None
        if self._views:
            if self.cuda:
                for view, t in zip(self._views, self.tensors):
                    view.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
            else:
                torch._foreach_copy_(self._views, self.tensors)
            return
        # On CUDA the bound is one non-blocking copy per tensor into page-locked memory
        # and one synchronise at the end, as torchtitan's staging does.
        for offset, t in zip(self.offsets, self.tensors):
            self.buffer[offset:offset + t.nbytes].view(t.dtype).view(t.shape).copy_(
                t, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()

    def raw_bytes(self) -> memoryview:
        """The staged bytes (valid after one :meth:`start`)."""
        assert self._map is not None
        return memoryview(self._map)

    def close(self) -> None:
        if self.cuda and self.buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer = None
        self._views = []
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
        if os.path.exists(self.shm_path):
            os.unlink(self.shm_path)


class FreshClone(Method):
    """``clone()`` of every tensor into newly allocated memory (what naive staging does)."""

    kind = "bound"
    writes = False

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.cuda = any(t.is_cuda for t in tensors)
        self.name = "fresh .cpu() copy" if self.cuda else "fresh clone()"
        self.copies: list = []

    def start(self, path: str) -> None:
        self.copies = [t.to("cpu", copy=True) for t in self.tensors]

    def wait_durable(self) -> None:
        self.copies = []


class RawWrite(Method):
    """Sequential write of the staged bytes to one file, fsync at the end (the disk limit)."""

    kind = "bound"

    def __init__(self, source: PreallocatedCopy, direct: bool = False,
                 from_shared: bool = False) -> None:
        self.source = source
        self.direct = direct
        # from_shared: O_DIRECT from the source's own shared-memory mapping (memory of the
        # kind ckptd's staging pool is: tmpfs pages) instead of private anonymous memory.
        self.from_shared = from_shared
        self.name = "raw write O_DIRECT + fsync" if direct else "raw write + fsync"
        if from_shared:
            self.name += " (from shared memory)"
        self._aligned: mmap.mmap | None = None

    def prepare(self) -> None:
        if self.direct and not self.from_shared:
            # O_DIRECT needs a page-aligned source: an anonymous mapping is one. Private
            # (mmap's default, MAP_SHARED, is tmpfs memory: 4 KiB pages wherever
            # shmem_enabled is never, scattered as the machine's free memory happens to
            # be, which cut the disk's requests to ~0.5-2.6 MiB and made the bound 0.2 s
            # slower on a fragmented day) and on huge pages where the kernel gives them
            # (transparent_hugepage madvise or always), as a tuned writer would allocate
            # it: the strictest bound, with full-size requests every time.
            self._aligned = mmap.mmap(-1, self.source.size,
                                      flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            with contextlib.suppress(AttributeError, OSError):  # no THP: 4 KiB pages
                self._aligned.madvise(mmap.MADV_HUGEPAGE)
            self._aligned[:] = self.source.raw_bytes()

    def start(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, "raw.bin")
        data = memoryview(self._aligned) if self._aligned is not None else self.source.raw_bytes()
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        fd = os.open(target, flags, 0o644)
        try:
            for at in range(0, len(data), CHUNK):
                view = data[at:at + CHUNK]
                done = 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(path)

    def close(self) -> None:
        if self._aligned is not None:
            self._aligned.close()
            self._aligned = None


# ---------------------------------------------------------------- PyTorch baselines

class TorchSave(Method):
    """``torch.save`` to a file, then fsync."""

    name = "torch.save + fsync"

    def __init__(self, state: dict) -> None:
        self.state = state

    def start(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        target = os.path.join(path, "ckpt.pt")
        with open(target, "wb") as f:
            torch.save(self.state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(path)


class DcpSave(Method):
    """Stock ``torch.distributed.checkpoint.save`` with ``FileSystemWriter`` (defaults)."""

    name = "DCP save (sync)"

    def __init__(self, state: dict) -> None:
        self.state = state

    def start(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self.state, storage_writer=dcp.FileSystemWriter(path))


class DcpAsyncSave(Method):
    """Stock DCP ``async_save`` with the process executor.

    ``stager="default"`` is what ``async_save`` does with no stager (a fresh CPU copy per
    save, handed to the checkpoint process through torch.multiprocessing);
    ``stager="shared"`` passes one ``DefaultStager`` reused across saves, staging into
    cached shared memory (pinned too when CUDA is present) -- the fastest stock setup;
    ``stager="async"`` is torchtitan's pattern: the same stager with
    ``use_async_staging=True`` (the copy runs in a stager thread, overlapping the next
    forward/backward) and the trainer waiting on ``staging_completion`` right before
    ``optimizer.step`` (:meth:`before_update`).
    """

    kind = "async"

    def __init__(self, state: dict, stager: str = "default") -> None:
        self.state = state
        self.stager_kind = stager
        self.name = {"default": "DCP async_save (process, default stager)",
                     "shared": "DCP async_save (process, shm stager reused)",
                     "async": "torchtitan pattern (DCP, async staging)"}[stager]
        self.stager = None
        self.future = None
        self.staging = None

    def prepare(self) -> None:
        if self.stager_kind in ("shared", "async"):
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            overlap = self.stager_kind == "async"
            self.stager = DefaultStager(StagingOptions(use_pinned_memory=cuda,
                                                       use_shared_memory=True,
                                                       use_async_staging=overlap,
                                                       use_non_blocking_copy=overlap and cuda))

    def start(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        response = dcp.async_save(self.state, storage_writer=dcp.FileSystemWriter(path),
                                  async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                  async_stager=self.stager)
        self.future = getattr(response, "upload_completion", response)
        self.staging = getattr(response, "staging_completion", None)

    def before_update(self) -> None:
        staging, self.staging = self.staging, None
        if staging is not None:
            staging.result()

    def wait_durable(self) -> None:
        self.before_update()
        future, self.future = self.future, None
        if future is not None:
            future.result()

    def helper_pids(self) -> list[int]:
        from torch.distributed.checkpoint import _async_process_executor as ape

        proc = getattr(ape, "_CHECKPOINT_PROCESS", None)
        return [proc._save_process.pid] if proc is not None else []

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


def stop_dcp_checkpoint_process() -> None:
    """End DCP's background checkpoint process (so it does not linger in later numbers)."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    if getattr(ape, "_CHECKPOINT_PROCESS", None) is not None:
        ape._CHECKPOINT_PROCESS = None  # its __del__ sends TERMINATE and joins the process
        gc.collect()


# ---------------------------------------------------------------- ckptd

def _daemon_tree(daemon_pid: int) -> list[int]:
    from procmem import descendants

    return [daemon_pid, *descendants(daemon_pid)]


class CkptdTorch(Method):
    """``ckpt_client.TorchAsyncCheckpoint().async_save`` through the node's daemon.

    With ``zero_stall`` the call returns once the save is registered and the trainer
    waits for staging in :meth:`before_update` (what ``guard_optimizer`` does).
    """

    kind = "async"

    def __init__(self, state: dict, zero_stall: bool = False) -> None:
        self.state = state
        self.zero_stall = zero_stall
        self.name = "ckptd TorchAsyncCheckpoint" + (" (zero_stall)" if zero_stall else "")
        self.ckpt = None
        self.daemon_pid = 0

    def prepare(self) -> None:
        import ckpt_client

        self.ckpt = ckpt_client.TorchAsyncCheckpoint()
        self.daemon_pid = ckpt_client.connect().daemon_pid

    def start(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        self.ckpt.async_save(self.state, os.path.join(path, "ckpt.pt"), zero_stall=self.zero_stall)

    def before_update(self) -> None:
        self.ckpt.wait_for_staging()

    def wait_durable(self) -> None:
        self.ckpt.finalize_async_save(blocking=True)

    def helper_pids(self) -> list[int]:
        return _daemon_tree(self.daemon_pid)

    def close(self) -> None:
        if self.ckpt is not None:
            self.ckpt.close()


class CkptdDcp(Method):
    """``ckpt_client.dcp.async_save`` scheduled on an ``AsyncCallsQueue``.

    ``own_planning``: with ``CKPTD_DCP_FAST_PLAN`` off, so the default planner plans
    through DCP's own calls, as the code did before its short route (the row that shows
    that change before and after in one run: the trainer cannot import two versions of
    ckpt_client). ``copy_after_plan``: with ``CKPTD_DCP_GUESS_PLAN`` off, so a blocking
    save copies after planning instead of beside it, as before the guessed copy.
    """

    kind = "async"

    def __init__(self, state: dict, enable_cache: bool = False, zero_stall: bool = False,
                 own_planning: bool = False, copy_after_plan: bool = False) -> None:
        self.state = state
        self.enable_cache = enable_cache
        self.zero_stall = zero_stall
        self.own_planning = own_planning
        self.knobs = {**({"DCP_FAST_PLAN": False} if own_planning else {}),
                      **({"DCP_GUESS_PLAN": False} if copy_after_plan else {})}
        options = [o for o, on in (("enable_cache", enable_cache), ("zero_stall", zero_stall),
                                   ("DCP's own planning", own_planning),
                                   ("copy after planning", copy_after_plan)) if on]
        self.name = "ckptd dcp.async_save" + (f" ({', '.join(options)})" if options else "")
        self.queue = None
        self.daemon_pid = 0

    def prepare(self) -> None:
        import ckpt_client

        self.queue = ckpt_client.AsyncCallsQueue()
        self.daemon_pid = ckpt_client.connect().daemon_pid

    def start(self, path: str) -> None:
        from ckpt_client import dcp as ckpt_dcp
        from ckptd import knobs

        with knobs.override(**self.knobs):
            self.queue.schedule_async_request(
                ckpt_dcp.async_save(self.state, path, enable_cache=self.enable_cache,
                                    zero_stall=self.zero_stall))

    def before_update(self) -> None:
        self.queue.wait_for_staging()

    def wait_durable(self) -> None:
        self.queue.maybe_finalize_async_calls(blocking=True)

    def helper_pids(self) -> list[int]:
        return _daemon_tree(self.daemon_pid)

    def close(self) -> None:
        if self.queue is not None:
            self.queue.close()


def remove_tree(path: str) -> None:
    """Delete a checkpoint directory left by a run."""
    shutil.rmtree(path, ignore_errors=True)


def bytes_under(path: str, keep: Callable[[str], bool] = lambda name: True) -> int:
    """Total size of the files under ``path`` whose name passes ``keep``."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            if keep(name):
                try:
                    total += os.path.getsize(os.path.join(dirpath, name))
                except OSError:
                    pass
    return total
