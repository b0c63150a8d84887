"""torchtitan: its ``CheckpointManager`` saving through ckptd.

:class:`CkptdCheckpointManager` is torchtitan's DCP checkpoint manager with one seam
changed, ``dcp_save``: every save goes through ``torch.distributed.checkpoint`` with
:class:`ckpt_client.dcp.StorageWriter` (the daemon writes, fsyncs and commits
``.metadata`` last) and, in the async modes, :class:`ckpt_client.dcp.Stager` (the daemon
stages). Everything else is torchtitan's own: when to save, ``keep_latest_k`` retention
(it only ever purges older steps, after waiting for the save in flight), resume (stock
``dcp.load`` of the newest ``step-N`` with a ``.metadata``), and the trainer's
``checkpointer.maybe_wait_for_staging()`` before ``optimizers.step()``, which here waits
for the daemon's staging.

``checkpoint.async_mode``:

- ``"disabled"``: ``dcp.save`` with ckptd's writer (blocking until durable);
- ``"async"``: ``dcp.async_save`` with a blocking ``Stager``: returns once the daemon
  holds every byte;
- ``"async_with_pinned_mem"``: zero-stall ``Stager``: returns at once; staging overlaps
  the next forward and backward, and ``maybe_wait_for_staging`` waits for it.

In both async modes the stager remembers the save plan: from the second save of an
unchanged structure on, the daemon stages the state before DCP plans the save, and DCP's
planning (its collectives included) runs after the trainer was released.

Saves in Hugging Face safetensors (``last_save_in_hf``) stay torchtitan's own.

Use it by building it instead of torchtitan's manager::

    from ckpt_client.integrations.torchtitan import CkptdCheckpointManager
    config.checkpoint = CkptdCheckpointManager.Config(**fields_of_the_old_config)
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any

from ckpt_client.integrations.versions import require

require("torchtitan")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import (AsyncCheckpointerType,  # noqa: E402
                                                           AsyncSaveResponse)
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager  # noqa: E402

from ckpt_client.dcp import Stager, StorageWriter  # noqa: E402

__all__ = ["CkptdCheckpointManager"]


class CkptdCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager``, saving through the node's ckptd.

    Takes torchtitan's arguments unchanged; its ``Config`` adds ``socket`` (the daemon
    socket; default ``CKPTD_SOCKET`` or the auto-started node daemon).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        socket: str | None = None
        """ckptd socket (default: ``CKPTD_SOCKET``, else the auto-started node daemon)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self._socket = getattr(config, "socket", None)
        # One stager for every save: it remembers the save plan, so a save whose
        # structure is unchanged is staged before DCP plans it.
        self._blocking_stager = Stager()
        if self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            # Set before torchtitan's _save would create its DefaultStager.
            self.stager = Stager(zero_stall=True)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False,
                 to_hf: bool = False) -> Future | AsyncSaveResponse | None:
        """Save through ckptd (see the module docstring); HF-format saves stay torchtitan's."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        writer = StorageWriter(checkpoint_id, socket=self._socket)
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer)
            return None
        stager = (self.stager if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM
                  else self._blocking_stager)
        # The thread executor: the daemon takes the bytes straight from the tensors; the
        # process executor would first copy them into shared memory for DCP's helper.
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD,
                              async_stager=stager)
