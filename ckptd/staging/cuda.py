"""Staging CUDA tensors of trainers: open their IPC handles, copy device-to-host.

Owns the daemon's CUDA side: the page-locked registration of the staging pool, a CUDA
context on each device before a handle is opened, device matching by UUID, the cache of
opened mappings per trainer process (reused across saves, dropped when a save no longer
names them or the trainer goes away), and a worker thread that does the copies so the
serve loop keeps answering. Jobs and results are typed (:class:`CudaJob`,
:class:`CudaStaged`) and cross threads through :class:`ckptd.mailbox.Mailbox` es; the
stager never sees a request object. Only loaded when the node has an NVIDIA driver.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass

import zmq

from ckptd import protocol
from ckptd.mailbox import Mailbox

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudaJob:
    """Copy a request's CUDA tensors (client IPC descriptions) into its extent."""

    request_id: int
    base: int       # the extent's offset in the pool
    offsets: list   # of each buffer, relative to ``base``
    buffers: list   # [dtype, shape, nbytes] as the request declared them
    specs: list     # the client's IPC descriptions, one per buffer
    pid: int        # the trainer process that exported the handles


@dataclass(frozen=True)
class CudaStaged:
    """A :class:`CudaJob` finished: ``error`` is ``None`` when every byte is in the pool."""

    request_id: int
    error: str | None


@dataclass(frozen=True)
class _ForgetProcess:
    pid: int


_STOP = object()


class CudaStager:
    """Copies trainers' CUDA tensors into the staging pool on a worker thread."""

    @classmethod
    def create_if_available(cls, pool) -> "CudaStager | None":
        """A stager if this node has a usable CUDA device, else ``None``."""
        if not os.path.exists("/proc/driver/nvidia/version"):
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        pool.register_with_cuda()
        return cls(pool)

    def __init__(self, pool) -> None:
        import torch

        self.torch = torch
        self.pool = pool
        self.pool_tensor = torch.frombuffer(pool._map, dtype=torch.uint8)
        self.devices = {str(torch.cuda.get_device_properties(i).uuid): i
                        for i in range(torch.cuda.device_count())}
        self._opened: dict[int, dict] = {}  # trainer pid -> {(handle, offset): storage}
        # Jobs wait in a plain queue (the stager thread blocks on it); results go back to
        # the serve loop through a mailbox it polls.
        self._jobs: queue.Queue = queue.Queue()
        #: Results for the serve loop: poll ``results.doorbell``, then ``results.drain``.
        self.results = Mailbox(zmq.Context.instance(), "cuda-staged")
        self._thread = threading.Thread(target=self._run, name="ckptd-cuda-staging", daemon=True)
        self._thread.start()

    def submit(self, job: CudaJob) -> None:
        """Queue a device-to-host copy; a :class:`CudaStaged` comes back in :attr:`results`."""
        self._jobs.put(job)

    def forget_process(self, pid: int) -> None:
        """Drop the mappings opened for a trainer that went away."""
        self._jobs.put(_ForgetProcess(pid))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, _ForgetProcess):
                self._opened.pop(job.pid, None)
                continue
            try:
                self._stage(job)
                error = None
            except Exception as exc:  # reported to the trainer, never kills the thread
                log.exception("CUDA staging of request %d failed", job.request_id)
                error = f"CUDA staging failed on the daemon: {type(exc).__name__}: {exc}"
            self.results.post(CudaStaged(job.request_id, error))

    def _stage(self, job: CudaJob) -> None:
        torch = self.torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        cache = self._opened.setdefault(job.pid, {})
        used = {}
        base = job.base
        streams = {}
        for spec, offset, (_, _, expected_nbytes) in zip(job.specs, job.offsets, job.buffers):
            device = self.devices.get(spec["device_uuid"])
            if device is None:
                raise RuntimeError(f"the trainer's GPU {spec['device_uuid']} is not visible to "
                                   "the daemon; give ckptd the same devices (CUDA_VISIBLE_DEVICES)")
            if spec.get("dtype") not in protocol.BUFFER_DTYPES or spec["dtype"] == "bytes":
                raise ValueError(f"unsupported dtype {spec.get('dtype')!r} in a CUDA IPC description")
            torch.cuda.set_device(device)  # a context must exist before opening the handle
            key = (spec["handle"], spec["storage_offset"])
            dtype = getattr(torch, spec["dtype"])
            source = rebuild_cuda_tensor(
                torch.Tensor, spec["size"], spec["stride"], spec["offset"], torch.UntypedStorage,
                dtype, device, spec["handle"], spec["storage_size"], spec["storage_offset"], False,
                spec["ref_counter_handle"], spec["ref_counter_offset"], spec["event_handle"],
                spec["event_sync_required"])
            used[key] = source.untyped_storage()
            nbytes = source.numel() * source.element_size()
            if nbytes != expected_nbytes:
                raise ValueError(f"IPC tensor of {nbytes} bytes does not match the {expected_nbytes} "
                                 "bytes the request declared; refusing to write past its extent")
            if nbytes:
                start = base + offset
                destination = self.pool_tensor[start:start + nbytes].view(dtype).view(source.shape)
                stream = streams.setdefault(device, torch.cuda.Stream(device))
                with torch.cuda.stream(stream):
                    destination.copy_(source, non_blocking=self.pool.registered_with_cuda)
        for stream in streams.values():
            stream.synchronize()
        # Keep only what this save used: a handle the trainer no longer sends belongs to
        # an allocation it freed or replaced.
        cache.clear()
        cache.update(used)

    def close(self) -> None:
        """Stop the worker thread and close the result mailbox."""
        self._jobs.put(_STOP)
        self._thread.join(timeout=5)
        self.results.close()
