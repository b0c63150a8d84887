"""Exporting CUDA tensors to the daemon as IPC handles (torch's own reductions).

The handle bytes, offsets and event handle come from
``torch.multiprocessing.reductions.reduce_tensor``; we send them as msgpack fields, never
pickled. Devices are named by UUID because the daemon's ``CUDA_VISIBLE_DEVICES`` may
differ from ours. When IPC cannot work (expandable segments share memory through
``pidfd_getfd``, which Yama ptrace rules deny to a non-parent process), we fall back to
copying into the shared-memory pool ourselves and say why, once.
"""

from __future__ import annotations

import logging
import os
import warnings

import torch

log = logging.getLogger(__name__)
_warned: set[str] = set()


def ipc_blocked_reason() -> str | None:
    """Why CUDA IPC to the daemon cannot work in this process, or ``None``."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments:true" not in conf.replace(" ", "").lower():
        return None
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            scope = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return None
    if scope == 0:
        return None
    return (f"expandable segments are on (PYTORCH_CUDA_ALLOC_CONF) and Yama ptrace_scope={scope} "
            "denies pidfd_getfd to the daemon, which is not our parent")


def export_for_daemon(connection, sources: list) -> list | None:
    """IPC descriptions of ``sources`` if the daemon can stage them itself, else ``None``.

    Only when every source is a CUDA tensor and the daemon has CUDA; otherwise the
    caller copies into the pool (CUDA tensors included, device-to-host).
    """
    if not sources or not connection.has_cuda:
        return None
    if not all(isinstance(s, torch.Tensor) and s.is_cuda for s in sources):
        return None
    reason = ipc_blocked_reason()
    if reason is not None:
        if reason not in _warned:
            _warned.add(reason)
            warnings.warn(f"ckptd: staging CUDA tensors through shared memory instead of CUDA "
                          f"IPC: {reason}", RuntimeWarning, stacklevel=3)
        return None
    from torch.multiprocessing.reductions import reduce_tensor

    exported = []
    for tensor in sources:
        _, args = reduce_tensor(tensor)
        (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset,
         _, ref_handle, ref_offset, event_handle, event_sync) = args
        exported.append({
            "size": list(size), "stride": list(stride), "offset": offset,
            "dtype": str(dtype).removeprefix("torch."),
            "device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "handle": handle, "storage_size": storage_size, "storage_offset": storage_offset,
            "ref_counter_handle": ref_handle, "ref_counter_offset": ref_offset,
            "event_handle": event_handle, "event_sync_required": event_sync,
        })
    return exported
