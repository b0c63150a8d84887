"""Which buffers the daemon copies from CUDA IPC handles, and their export (torch's reductions).

Mixed transport: in one save, every CUDA tensor the daemon can open is handed over as an
IPC description (the handle bytes, offsets and ref counter from
``torch.multiprocessing.reductions.reduce_tensor``, sent as msgpack fields, never
pickled); everything else (CPU tensors, byte items, zero-size tensors, tensors on a GPU
the daemon cannot see, every CUDA tensor when IPC cannot work in this process) goes
through the shared-memory pool, copied by this process. :func:`route` makes that choice
from plain facts, so it is testable without a GPU.

Devices are matched by UUID (the daemon's ``CUDA_VISIBLE_DEVICES`` may differ from ours).
Each storage is exported once and the description reused while the tensor keeps its
allocation (re-exporting grows torch's per-storage sent-data chain). Every save records a
fresh inter-process event on each device's current stream: the daemon's copy stream
waits on it, so the copy is ordered after the kernels that produced the values.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)
_warned: set[str] = set()

IPC, SHM = "ipc", "shm"


def ipc_blocked_reason(daemon_pid: int | None = None) -> str | None:
    """Why CUDA IPC to the daemon cannot work in this process, or ``None``.

    Expandable segments share memory through ``pidfd_getfd``, which Yama ptrace scope
    >= 1 denies to a process that is not our descendant (the daemon). Under scope 1 this
    process names the daemon as its ptracer (``prctl(PR_SET_PTRACER, daemon_pid)``), which
    lets it in; scopes 2 and 3 allow only administrators or nobody. The allocator's
    setting may come from the environment or be changed at run time.
    """
    if not _expandable_segments():
        return None
    return _yama_verdict(_yama_scope(), daemon_pid, allow_ptracer)


def _expandable_segments() -> bool:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = "expandable_segments:true" in conf.replace(" ", "").lower()
    try:
        expandable = expandable or bool(torch.cuda.memory._get_current_allocator()  # noqa: SLF001
                                        and _runtime_expandable())
    except Exception:  # an older torch or no CUDA: the environment is all we know
        pass
    return expandable


def _yama_scope() -> int:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0  # no Yama: ptrace rules alone, which let a same-user daemon in


def _yama_verdict(scope: int, daemon_pid: int | None, allow) -> str | None:
    """The blocking reason for expandable segments under Yama ``scope`` (see
    :func:`ipc_blocked_reason`); ``allow(pid)`` names the daemon as our ptracer."""
    if scope == 0:
        return None
    if scope == 1 and daemon_pid:
        error = allow(daemon_pid)
        if error is None:
            return None
        return (f"expandable segments are on, Yama ptrace_scope=1 denies pidfd_getfd to the "
                f"daemon, and naming it our ptracer failed ({error})")
    return (f"expandable segments are on and Yama ptrace_scope={scope} denies pidfd_getfd "
            "to the daemon, which is not our parent; run the daemon as our parent, lower "
            "the scope to 1, or turn expandable segments off")


_PR_SET_PTRACER = 0x59616D61
_ptracer_allowed: set[int] = set()


def allow_ptracer(pid: int) -> str | None:
    """Let process ``pid`` attach to this one under Yama scope 1 (``PR_SET_PTRACER``);
    returns ``None`` on success, else the error. Done once per daemon pid."""
    if pid in _ptracer_allowed:
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    _ptracer_allowed.add(pid)
    log.info("named ckptd (pid %d) our ptracer so that it can open expandable segments "
             "(Yama ptrace_scope=1)", pid)
    return None


def _runtime_expandable() -> bool:
    settings = getattr(torch._C, "_cuda_getAllocatorSettings", None)  # noqa: SLF001
    return bool(settings and "expandable_segments:True" in str(settings()))


@dataclass(frozen=True)
class BufferFacts:
    """What the routing needs to know about one buffer."""

    is_cuda: bool
    device_uuid: str | None
    nbytes: int
    contiguous: bool = True


def route(buffers: list[BufferFacts], daemon_devices: set[str] | None,
          blocked: str | None) -> tuple[list[str], list[str]]:
    """Decide, per buffer, whether the daemon copies it from IPC or we copy it via shm.

    Parameters
    ----------
    buffers : list of BufferFacts
    daemon_devices : set of str or None
        UUIDs of the GPUs the daemon can open (None: it has no CUDA at all).
    blocked : str or None
        Why IPC cannot work in this process (:func:`ipc_blocked_reason`), if it cannot.

    Returns
    -------
    (routes, warnings)
        ``"ipc"`` or ``"shm"`` per buffer, and what to tell the user (once each).
    """
    routes, notes = [], []
    for facts in buffers:
        # A strided tensor is copied here: a device-to-host copy of it needs a contiguous
        # temporary on the GPU, which must be the trainer's own, not one the daemon makes.
        if (not facts.is_cuda or facts.nbytes == 0 or not facts.contiguous
                or not daemon_devices or blocked):
            routes.append(SHM)
            if facts.is_cuda and facts.nbytes and daemon_devices and blocked:
                notes.append(f"staging CUDA tensors through shared memory instead of CUDA "
                             f"IPC: {blocked}")
            continue
        if facts.device_uuid not in daemon_devices:
            routes.append(SHM)
            notes.append(f"the daemon cannot see GPU {facts.device_uuid} (its "
                         "CUDA_VISIBLE_DEVICES differs); tensors on it are copied through "
                         "shared memory by the trainer")
            continue
        routes.append(IPC)
    return routes, sorted(set(notes))


def _facts(source) -> BufferFacts:
    if not isinstance(source, torch.Tensor) or not source.is_cuda:
        nbytes = source.numel() * source.element_size() if isinstance(source, torch.Tensor) else 0
        return BufferFacts(False, None, nbytes)
    return BufferFacts(True, _uuid(source.device.index),
                       source.numel() * source.element_size(), source.is_contiguous())


def _uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


# Export cache: a tensor object -> (its allocation's address, its IPC description); valid
# while the tensor still points at that allocation.
_exported: "weakref.WeakKeyDictionary[torch.Tensor, tuple]" = weakref.WeakKeyDictionary()


def _export(tensor: torch.Tensor) -> dict:
    address = tensor.untyped_storage().data_ptr()
    cached = _exported.get(tensor)
    if cached is not None and cached[0] == address:
        return cached[1]
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor)
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset,
     _, ref_handle, ref_offset, event_handle, event_sync) = args
    spec = {"size": list(size), "stride": list(stride), "offset": offset,
            "dtype": str(dtype).removeprefix("torch."), "device_uuid": _uuid(device),
            "handle": handle, "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": ref_handle, "ref_counter_offset": ref_offset,
            "event_handle": event_handle, "event_sync_required": event_sync}
    _exported[tensor] = (address, spec)
    return spec


def plan_ipc(connection, sources: list) -> tuple[list | None, list]:
    """One entry per source: the IPC description the daemon copies from, or ``None``.

    Returns
    -------
    (specs, events)
        ``specs`` is ``None`` when no source goes by IPC (a shm-only request). ``events``
        are the producer events recorded here (one per device and save), which order the
        daemon's copy after the work queued so far on each device's current stream; keep
        them alive until the save is staged.
    """
    if not connection.has_cuda or not any(isinstance(s, torch.Tensor) and s.is_cuda
                                          for s in sources):
        return None, []
    blocked = connection.ipc_denied or ipc_blocked_reason(connection.daemon_pid)
    routes, notes = route([_facts(s) for s in sources], set(connection.cuda_devices), blocked)
    for note in notes:
        if note not in _warned:
            _warned.add(note)
            warnings.warn(f"ckptd: {note}", RuntimeWarning, stacklevel=3)
    if IPC not in routes:
        return None, []
    ready: dict[int, bytes] = {}
    specs, events = [], []
    for source, how in zip(sources, routes):
        if how != IPC:
            specs.append(None)
            continue
        index = source.device.index
        if index not in ready:
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(index))
            ready[index] = event.ipc_handle()
            events.append(event)
        specs.append({**_export(source), "ready_event": ready[index]})
    return specs, events
