"""CUDA IPC reference counters: which export a handle is, and paying its release.

torch counts, per exported CUDA storage, how many processes still use it; the trainer
may free the memory only once each export's counter is released. Both the daemon (done
copying) and the client (the daemon died, so it pays what the daemon owed) follow these
rules. Importing this module must not import torch: only a side that holds CUDA
descriptions calls :func:`release_ipc_counters`, which imports it then.
"""

from __future__ import annotations

import logging

__all__ = ["ipc_export_id", "release_ipc_counters"]

logger = logging.getLogger(__name__)


def ipc_export_id(spec: dict) -> tuple:
    """Which export a CUDA IPC description is: torch gives every export of a storage its
    own reference-counter slot, and each slot is owed exactly one release."""
    return (spec["ref_counter_handle"], spec["ref_counter_offset"])


def release_ipc_counters(specs) -> None:
    """Pay the release each description's export is owed (torch's
    ``_release_ipc_counter_cuda``), once per export; a counter file already gone means its
    trainer is gone too, and is skipped."""
    import torch  # only a side that holds CUDA descriptions calls this

    for export in {ipc_export_id(spec) for spec in specs}:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*export)  # noqa: SLF001
        except Exception as exc:
            logger.debug("could not release IPC counter %s: %s", export, exc)
