"""Which buffers of a save the daemon copies from CUDA IPC handles, and which we copy.

Mixed transport: in one save, every CUDA tensor the daemon can open is handed over as an
IPC description (:mod:`ckpt_client.transport.cuda_exports`); everything else (CPU
tensors, byte items, zero-size tensors, tensors on a GPU the daemon cannot see, every
CUDA tensor when IPC cannot work in this process) goes through the shared-memory pool,
copied by this process. :func:`route` makes that choice from plain facts
(:class:`BufferFacts`), so it is testable without a GPU. Devices are matched by UUID (the
daemon's ``CUDA_VISIBLE_DEVICES`` may differ from ours).

IPC cannot work when the allocator uses expandable segments and the kernel's Yama
ptrace policy denies the daemon ``pidfd_getfd`` on us: :func:`ipc_blocked_reason` says
so, and under scope 1 names the daemon our ptracer (:func:`allow_ptracer`), which lets
it in.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

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


def facts_of(source) -> BufferFacts:
    if not isinstance(source, torch.Tensor) or not source.is_cuda:
        nbytes = source.numel() * source.element_size() if isinstance(source, torch.Tensor) else 0
        return BufferFacts(False, None, nbytes)
    return BufferFacts(True, device_uuid(source.device.index),
                       source.numel() * source.element_size(), source.is_contiguous())


_uuids: dict[int, str] = {}  # a process's device indices never change once CUDA is up


def device_uuid(index: int) -> str:
    """The UUID of local device ``index`` (asked of torch once: it is asked per tensor)."""
    uuid = _uuids.get(index)
    if uuid is None:
        uuid = _uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
    return uuid
