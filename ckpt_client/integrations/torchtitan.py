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

Retention (``keep_latest_k``) counts only complete steps: a ``step-N`` folder with a
``.metadata`` (or a Hugging Face index), which ckptd's writer commits last, once every
file is durable. torchtitan's own retention counts every ``step-N`` folder, so a step
still being written, or one a killed run left without ``.metadata``, took the place of a
loadable one: with ``keep_latest_k=1`` the last loadable step was deleted as soon as the
next save began. Here the newest ``keep_latest_k`` complete steps are kept, older
complete steps are purged, and a folder without ``.metadata`` is never touched (it may be
the save in flight; one a killed run left is saved into again when the resumed run
reaches that step).

Use it by building it instead of torchtitan's manager::

    from ckpt_client.integrations.torchtitan import CkptdCheckpointManager
    config.checkpoint = CkptdCheckpointManager.Config(**fields_of_the_old_config)
"""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import Future
from typing import Any

from ckpt_client.integrations.versions import require

require("torchtitan")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import (AsyncCheckpointerType,  # noqa: E402
                                                           AsyncSaveResponse)
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager  # noqa: E402
from torchtitan.tools import filesystem  # noqa: E402

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

    def _purge_stale_checkpoints(self) -> None:
        """Queue for deletion the complete steps older than the newest ``keep_latest_k``
        complete ones (see the module docstring); incomplete steps are left alone."""
        if not self._should_purge():
            return
        complete = sorted((step, path) for step, path in _step_folders(self.folder)
                          if _is_complete(path))
        for _, path in complete[:-self.keep_latest_k]:
            self.purge_queue.put(path)


_STEP_FOLDER = re.compile(r"step-(\d+)$")


def _step_folders(folder: str) -> list[tuple[int, str]]:
    found = []
    for name in filesystem.listdir(folder):
        match = _STEP_FOLDER.search(name)
        if match:
            found.append((int(match.group(1)), filesystem.join(folder, name)))
    return found


def _is_complete(path: str) -> bool:
    # the markers torchtitan's own resume looks for: written last, once the step is whole
    return any(filesystem.isfile(filesystem.join(path, marker))
               for marker in (".metadata", "model.safetensors.index.json"))
