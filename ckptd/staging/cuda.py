"""Staging CUDA tensors of trainers: open their IPC handles, copy device-to-host, in order.

Owns the daemon's CUDA side:

- one worker thread and one persistent copy stream per visible device, with the CUDA
  context created at daemon start (not inside the first save); devices are matched by
  UUID, since the trainer's ``CUDA_VISIBLE_DEVICES`` may differ from ours;
- stream order: each save carries, per device, an inter-process event the trainer
  recorded on its current stream; the copy stream waits on it before copying, so the copy
  sees the values the trainer's queued kernels produce, whether the mapping is new or
  cached;
- IPC reference counters, paid exactly once per export, through the bookkeeping of
  :mod:`ckptd.staging.exports` (each export opened at most once; the exports two
  consecutive saves used stay open, the rest are dropped once copied, so the trainer's
  temporaries are not pinned until the next save). A trainer's freed blocks thus neither
  stay in torch's sent-data limbo forever nor leave it early. The STAGED reply names the
  kept ones: the trainer re-sends those and exports the others afresh. A trainer that
  went away has everything dropped; events the daemon opened are destroyed with the save;
- safety: every copy is synchronized (also when one fails) before the extent's hold is
  dropped, so a reused extent is never still being written by the GPU;
- denial: when the kernel refuses us the trainer's memory (expandable segments share it
  through ``pidfd_getfd``, which Yama or a seccomp policy may deny), the result carries
  :attr:`ckptd.protocol.ErrorCode.IPC_DENIED`, so the trainer retries through shared
  memory instead of failing the save.

Jobs and results are typed (:class:`CudaJob`, :class:`CudaStaged`); results cross to the
serve loop through a :class:`ckptd.mailbox.Mailbox`. The stager never sees a request
object. Only loaded when the node has an NVIDIA driver; exercised by ``tests/gpu``.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from dataclasses import dataclass, field

import zmq

from ckptd import knobs, protocol
from ckptd.mailbox import Mailbox
from ckptd.protocol import ErrorCode
from ckptd.staging.copy_views import ReusedViews
from ckptd.staging.exports import OpenExports, SaveMappings, export_id

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CudaJob:
    """Copy a request's CUDA tensors (client IPC descriptions) into its extent."""

    request_id: int
    base: int       # the extent's offset in the pool
    offsets: list   # of each buffer, relative to ``base``
    buffers: list   # [dtype, shape, nbytes] as the request declared them
    specs: list     # per buffer: the client's IPC description, or None (trainer copies it)
    pid: int        # the trainer process that exported the handles


@dataclass(frozen=True)
class CudaStaged:
    """A :class:`CudaJob` finished: ``error`` is ``None`` when every byte is in the pool."""

    request_id: int
    error: str | None
    code: str | None = None  # an ErrorCode the trainer acts on (IPC_DENIED: retry via shm)
    kept: tuple = ()         # buffer indices whose export the daemon holds open now


#: What torch's allocator says when the kernel refuses to share an expandable segment
#: (pidfd_open / pidfd_getfd failing with EPERM or EACCES, or missing: ENOSYS). Other
#: errors of those calls (ESRCH: the trainer exited) are not a denial.
_DENIALS = ("Operation not permitted", "Permission denied", "does not support",
            "does not exist")


def denied_by_the_kernel(exc: BaseException) -> bool:
    """Whether opening a handle failed because the OS denied us the trainer's memory
    (not because the handle, the device or the trainer is gone or bad)."""
    text = str(exc)
    return "pidfd" in text and any(denial in text for denial in _DENIALS)


def staging_failure(exc: BaseException, pid: int) -> tuple[str, str | None]:
    """The message and error code a failed device copy reports to the trainer."""
    if denied_by_the_kernel(exc):
        return (f"the kernel denied ckptd (pid {os.getpid()}) the CUDA memory of trainer "
                f"pid {pid} ({str(exc).strip().splitlines()[0]}): expandable segments are "
                "shared through pidfd_getfd, which Yama (ptrace_scope 2 or 3, or 1 when the "
                "trainer could not name the daemon its ptracer), a seccomp profile or a "
                "kernel older than 5.6 forbids; the trainer stages through shared memory "
                "instead. For CUDA IPC, allow pidfd_getfd (Yama scope at most 1; the "
                "container's seccomp profile) or turn expandable segments off",
                ErrorCode.IPC_DENIED)
    return f"CUDA staging failed on the daemon: {type(exc).__name__}: {exc}", None


@dataclass(frozen=True)
class _Part:
    """The share of one job that one device copies."""

    job: CudaJob
    indices: list
    events: frozenset  # the trainer's ready events on this device (one a save, normally)


@dataclass
class _Progress:
    """A job's parts still copying, its first failure, and the exports kept so far."""

    left: int
    error: str | None = None
    code: str | None = None
    kept: list = field(default_factory=list)


@dataclass(frozen=True)
class _Forget:
    pid: int


@dataclass(frozen=True)
class _Release:
    """Descriptions of a save that will never be copied (refused, or failed early)."""

    pid: int | None
    specs: list


_STOP = object()


class _DeviceWorker:
    """The thread and copy stream of one device."""

    def __init__(self, stager: "CudaStager", device: int) -> None:
        torch = stager.torch
        self.stager, self.device, self.torch = stager, device, torch
        torch.cuda.set_device(device)  # the context exists before any handle is opened
        self.stream = torch.cuda.Stream(device)
        self._exports: dict[int, OpenExports] = {}  # trainer pid -> its exports held open
        self._views: dict[int, ReusedViews] = {}    # trainer pid -> its last save's views
        self.jobs: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=f"ckptd-cuda-{device}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.torch.cuda.set_device(self.device)
        path = knobs.CUDA_PROFILE.get()
        if not path:
            return self._serve()
        import cProfile
        import pstats

        profile = cProfile.Profile()
        try:
            profile.runcall(self._serve)
        finally:
            with open(f"{path}.{self.device}", "w") as out:
                pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(30)

    def _serve(self) -> None:
        while True:
            item = self.jobs.get()
            if item is _STOP:
                return
            if isinstance(item, _Forget):
                self._views.pop(item.pid, None)
                self._exports.pop(item.pid, None)  # dropping the storages pays their releases
                continue
            if isinstance(item, _Release):
                exports = self._exports.get(item.pid, OpenExports())
                protocol.release_ipc_counters(exports.unpaid(item.specs, set()))
                continue
            self._stage(item)

    def _stage(self, item: _Part) -> None:
        """Copy one part and report it (with the buffers whose export stays open)."""
        error = code = None
        kept: tuple = ()
        job = item.job
        exports = self._exports.setdefault(job.pid, OpenExports())
        views = self._views.setdefault(job.pid, ReusedViews())
        try:
            held = views.stage(exports, [job.specs[i] for i in item.indices], self._open,
                               lambda mappings: self._copy(item, mappings, views))
            kept = tuple(i for i in item.indices if export_id(job.specs[i]) in held)
        except Exception as exc:  # reported to the trainer, never kills the thread
            error, code = staging_failure(exc, item.job.pid)
            if code is not None:
                log.warning("request %d: %s", item.job.request_id, error)
            elif not isinstance(exc, InterruptedError):
                log.exception("CUDA staging of request %d on device %d failed",
                              item.job.request_id, self.device)
        self.stager.part_done(item.job, error, code, kept)

    def _copy(self, part: _Part, mappings: SaveMappings, views: ReusedViews) -> None:
        """Copy the part into its extent; synchronized before it returns or raises, so
        nothing still reads the trainer's memory or writes the extent afterwards."""
        if self.stager.is_cancelled(part.job.request_id):
            raise InterruptedError("the save was aborted before its copy started")
        try:
            self._copy_buffers(part, mappings, views)
        finally:
            self.stream.synchronize()

    def _copy_buffers(self, part: _Part, mappings: SaveMappings, views: ReusedViews) -> None:
        torch, job = self.torch, part.job
        if None in part.events:
            raise ValueError("a CUDA IPC description without its 'ready_event' handle: "
                             "the daemon cannot order its copy after the trainer's kernels")
        ready_events = [torch.cuda.Event.from_ipc_handle(self.device, handle)
                        for handle in part.events]  # destroyed with this frame
        for event in ready_events:  # order the copies after the trainer's kernels
            self.stream.wait_event(event)
        # Every view built (or reused) and checked before the first copy; then one call.
        destinations, sources = views.copies(
            torch, [job.specs[i] for i in part.indices],
            [job.base + job.offsets[i] for i in part.indices],
            [job.buffers[i][2] for i in part.indices], self.stager.pool_tensor, mappings)
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_(destinations, sources,
                                 non_blocking=self.stager.pool.registered_with_cuda)

    def _open(self, spec: dict):
        """Open an export's storage through torch (which, finding the storage already
        open under another export, pays this one's release at once)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        with self.torch.cuda.stream(self.stream):
            storage = rebuild_cuda_tensor(
                self.torch.Tensor, [0], [1], 0, self.torch.UntypedStorage, self.torch.uint8,
                self.device, spec["handle"], spec["storage_size"], spec["storage_offset"],
                False, spec["ref_counter_handle"], spec["ref_counter_offset"],
                spec["event_handle"], False).untyped_storage()
        log.debug("opened export %s of trainer storage at offset %d: mapped at %#x, %d bytes",
                  export_id(spec)[1], spec["storage_offset"], storage.data_ptr(), storage.nbytes())
        return storage


#: Where a loaded NVIDIA driver shows itself: the kernel module's proc entry, or its
#: device nodes (a container may get the nodes without the host's /proc/driver).
_DRIVER_SIGNS = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/nvidia0")


def nvidia_driver_present() -> bool:
    """Whether this node has an NVIDIA driver, checked without importing torch (which a
    daemon on a CPU-only node never needs)."""
    return any(os.path.exists(sign) for sign in _DRIVER_SIGNS)


def _pci_node(properties) -> int | None:
    from ckptd.staging.numa import pci_node

    try:
        return pci_node(properties.pci_domain_id, properties.pci_bus_id,
                        properties.pci_device_id)
    except AttributeError:  # a torch without PCI properties
        return None


class CudaStager:
    """Copies trainers' CUDA tensors into the staging pool, one worker per device.

    Results arrive in :attr:`results`: poll ``results.doorbell``, then ``results.drain``.
    """

    @classmethod
    def create_if_available(cls, pool) -> "CudaStager | None":
        """A stager if this node has a usable CUDA device, else ``None``."""
        if not nvidia_driver_present():
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
        #: GPU UUID -> the NUMA node it is attached to (where sysfs says).
        self.device_nodes = {uuid: node for uuid, node in
                             ((u, _pci_node(torch.cuda.get_device_properties(i)))
                              for u, i in self.devices.items()) if node is not None}
        self.workers = {index: _DeviceWorker(self, index) for index in self.devices.values()}
        self.results = Mailbox(zmq.Context.instance(), "cuda-staged")
        self._lock = threading.Lock()  # workers finish parts concurrently
        self._pending: dict[int, list] = {}  # request id -> [parts left, first error]
        self._cancelled: set[int] = set()

    def submit(self, job: CudaJob) -> None:
        """Queue a job; its parts go to the workers of their devices."""
        parts: dict[int, list] = {}
        events: dict[int, set] = {}
        unknown = []
        for index, spec in enumerate(job.specs):
            if spec is None:
                continue
            device = self.devices.get(spec.get("device_uuid"))
            (parts.setdefault(device, []) if device is not None else unknown).append(index)
            # Taken out of the description: it changes every save, the rest does not
            # (ReusedViews compares descriptions whole).
            handle = spec.pop("ready_event", None)
            events.setdefault(device, set()).add(handle if isinstance(handle, bytes) else None)
        if unknown:
            self.release(job.specs, job.pid)
            with self._lock:
                self.results.post(CudaStaged(job.request_id, (
                    f"the trainer's GPU {job.specs[unknown[0]].get('device_uuid')} is not "
                    "visible to the daemon; give ckptd the same devices (CUDA_VISIBLE_DEVICES)")))
            return
        with self._lock:
            self._pending[job.request_id] = _Progress(len(parts))
        for device, indices in parts.items():
            self.workers[device].jobs.put(_Part(job, indices, frozenset(events[device])))

    def cancel(self, request_id: int) -> None:
        """The save was aborted: parts not started yet open nothing."""
        with self._lock:
            if request_id in self._pending:
                self._cancelled.add(request_id)

    def is_cancelled(self, request_id: int) -> bool:
        """Whether the save was aborted (workers check before opening handles)."""
        with self._lock:
            return request_id in self._cancelled

    def part_done(self, job: CudaJob, error: str | None, code: str | None = None,
                  kept: tuple = ()) -> None:
        """A worker finished its part; the last one reports the job (with the first
        failure of its parts, and the exports every device keeps open)."""
        with self._lock:
            progress = self._pending.get(job.request_id)
            if progress is None:
                return
            progress.left -= 1
            progress.kept.extend(kept)
            if progress.error is None and error is not None:
                progress.error, progress.code = error, code
            if progress.left:
                return
            del self._pending[job.request_id]
            self._cancelled.discard(job.request_id)
            self.results.post(CudaStaged(job.request_id, progress.error, progress.code,
                                         tuple(sorted(progress.kept))))

    def release(self, specs: list, pid: int | None) -> None:
        """Release the counters of descriptions the daemon will never open (a refused or
        failed save of trainer ``pid``), except those a worker holds open: their release
        is paid when the worker drops them."""
        by_device: dict = {}
        for spec in specs:
            if spec is not None:
                by_device.setdefault(self.devices.get(spec.get("device_uuid")), []).append(spec)
        for device, owned in by_device.items():
            if device is None or pid is None:  # no worker can hold these open
                protocol.release_ipc_counters(owned)
            else:
                self.workers[device].jobs.put(_Release(pid, owned))

    def forget_process(self, pid: int) -> None:
        """Drop the mappings opened for a trainer that went away."""
        for worker in self.workers.values():
            worker.jobs.put(_Forget(pid))

    def close(self) -> None:
        """Stop the workers, close the result mailbox and drop the view of the pool."""
        for worker in self.workers.values():
            worker.jobs.put(_STOP)
        for worker in self.workers.values():
            worker.thread.join(timeout=5)
        self.results.close()
        # Ours would keep the retired range mapped for the daemon's life; a worker that
        # outlived its join holds its own reference (it fails its next job instead).
        self.pool_tensor = None
