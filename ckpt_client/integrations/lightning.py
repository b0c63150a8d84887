"""PyTorch Lightning: a ``CheckpointIO`` plugin whose files the node's ckptd writes.

``Trainer(plugins=[CkptdCheckpointIO()])``: ``save_checkpoint`` hands Lightning's
checkpoint dict to the daemon and returns in milliseconds (the training step goes on
while the tensors are staged and the daemon writes, fsyncs and renames); ``load_checkpoint`` and
``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k`` rotation) never act on a
checkpoint that is not durable: a load first waits for the saves in flight, and a removal
is deferred until they are durable (without blocking the training step), so a crash
while the newest save is being written still finds the checkpoints rotation would have
removed; ``teardown`` drains and carries out the deferred removals. The files are plain
``torch.save`` files: stock Lightning (``TorchCheckpointIO``) and ``torch.load`` read
them.

Zero-stall by default: the parameters and optimizer state (nearly all the bytes) are
copied into the daemon's pool in the background while the next training step runs its
forward and backward; the optimizer's update waits for that copy
(:class:`~ckpt_client.integrations.step_guard.StepGuard`, torch's global optimizer step
pre-hook: after ``step(closure)``'s closure, before the first parameter changes; at once
for a ``step()`` without closure). So the file holds exactly the state of the moment
``save_checkpoint`` was called. Every other tensor of the checkpoint (buffers a forward
pass updates, such as batch norm's running statistics, and any tensor of an optimizer
that has not stepped yet) is copied before ``save_checkpoint`` returns. Code that changes
parameters in place outside ``optimizer.step()`` between a save and the next step must
call :meth:`CkptdCheckpointIO.wait_for_staging` first, or use ``zero_stall=False`` (the
whole checkpoint staged before ``save_checkpoint`` returns).

A save over an existing file (``last.ckpt`` every time) goes to the path itself: the
daemon keeps the previous file until the new one is durable and puts it back if the save
fails or is aborted (the trainer killed mid-save), so there is never a gap where
``last.ckpt`` was.

Lightning calls the plugin on global rank 0 only, so this plugin never takes part in a
collective. A checkpoint holding a value ckptd's format cannot store without pickling
(an object in ``hyper_parameters``, say) is written by Lightning's own synchronous
``TorchCheckpointIO`` instead, with a warning naming the key.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ckpt_client.integrations.versions import require

require("lightning")

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # noqa: E402
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.fabric.utilities.cloud_io import get_filesystem  # noqa: E402
from lightning_utilities.core.apply_func import apply_to_collection  # noqa: E402

import torch  # noqa: E402

from ckpt_client import TorchAsyncCheckpoint  # noqa: E402
from ckpt_client.integrations.step_guard import StepGuard  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptdCheckpointIO"]


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptd.

    Parameters
    ----------
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`; default ``CKPTD_SOCKET`` or the
        auto-started node daemon).
    zero_stall : bool
        True (default): ``save_checkpoint`` returns before the parameters and optimizer
        state are staged, and the next optimizer update waits for them (see the module
        docstring). False: it returns once the whole checkpoint is staged.
    """

    def __init__(self, socket: str | None = None, zero_stall: bool = True) -> None:
        super().__init__()
        self._socket = socket
        self._zero_stall = zero_stall
        self._checkpoint: TorchAsyncCheckpoint | None = None
        self._in_flight: set[str] = set()
        self._removals: list[str] = []
        self._fallback = TorchCheckpointIO()
        self._guard = StepGuard(self.wait_for_staging, lambda: bool(self._in_flight))
        if zero_stall:
            # From the start, so the optimizer is known (its tensors left to the
            # background copy) by the first save.
            self._guard.install()

    @property
    def _async(self) -> TorchAsyncCheckpoint:
        if self._checkpoint is None:
            self._checkpoint = TorchAsyncCheckpoint(socket=self._socket)
        return self._checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Hand ``checkpoint`` to the daemon; return once it is queued (``zero_stall``)
        or staged.

        Raises
        ------
        TypeError
            If ``storage_options`` is given (as Lightning's ``TorchCheckpointIO``).
        ckpt_client.DaemonRequestError
            If the daemon refuses ``path`` (outside its ``--root`` directories, ...).
        ckpt_client.DaemonUnavailableError
            If no daemon answers (naming the socket and what to run).
        """
        if storage_options is not None:
            raise TypeError("`Trainer.save_checkpoint(..., storage_options=...)` with "
                            f"`storage_options` arg is not supported for `{type(self).__name__}`.")
        path = os.path.abspath(os.fspath(path))
        self._removals = [p for p in self._removals if p != path]  # saved anew: keep it
        self._finalize(blocking=False)
        get_filesystem(path).makedirs(os.path.dirname(path), exist_ok=True)
        try:
            if self._zero_stall:
                self._guard.install()  # again after a teardown
                self._async.async_save(self._snapshot(checkpoint), path, zero_stall=True)
            else:
                self._async.async_save(checkpoint, path)
        except TypeError as exc:  # a value our format cannot hold without pickling
            log.warning("%s; writing %s with Lightning's synchronous TorchCheckpointIO",
                        exc, path)
            self.wait_until_durable()
            self._fallback.save_checkpoint(checkpoint, path)
            return
        self._in_flight.add(path)

    def load_checkpoint(self, path, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Wait until saves in flight are durable, then load ``path`` as Lightning does."""
        self.wait_until_durable()
        return self._fallback.load_checkpoint(os.fspath(path), map_location=map_location,
                                              weights_only=weights_only)

    def remove_checkpoint(self, path) -> None:
        """Remove ``path`` (and its ckptd checksum record) once no save is in flight.

        Returns at once: while saves are in flight the removal waits for them (a newer
        checkpoint that is not durable yet must not cost the older one).
        """
        self._removals.append(os.path.abspath(os.fspath(path)))
        self._finalize(blocking=False)

    def wait_for_staging(self) -> None:
        """Return once every save handed over so far is staged (its tensors may change).

        Raises
        ------
        ckpt_client.CheckpointException
            If staging one of them failed.
        """
        if self._checkpoint is not None:
            self._checkpoint.wait_for_staging()

    def wait_until_durable(self) -> None:
        """Return once every save handed over so far is durable.

        Raises
        ------
        ckpt_client.CheckpointException
            If one of them failed (naming the file and errno).
        """
        self._finalize(blocking=True)

    def teardown(self) -> None:
        """Drain: every save durable, then release the daemon connection's queue."""
        try:
            self.wait_until_durable()
        finally:
            self._guard.remove()
            if self._checkpoint is not None:
                self._checkpoint.close()
                self._checkpoint = None

    def _snapshot(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """``checkpoint`` with a copy of every tensor an optimizer step does not own: only
        the guard keeps those from changing before they are staged."""
        only_steps_change = self._guard.only_steps_change()

        def keep_or_copy(tensor: torch.Tensor) -> torch.Tensor:
            if tensor.untyped_storage().data_ptr() in only_steps_change:
                return tensor
            return tensor.detach().clone()

        return apply_to_collection(checkpoint, torch.Tensor, keep_or_copy)

    def _finalize(self, blocking: bool) -> None:
        if self._checkpoint is not None:
            self._checkpoint.finalize_async_save(blocking=blocking, no_dist=True)
            if self._checkpoint.get_num_unfinalized_calls():
                return
        self._in_flight.clear()
        removals, self._removals = self._removals, []
        for path in removals:
            fs = get_filesystem(path)
            for name in (path, path + ".ckptd-sum"):
                if fs.exists(name):
                    fs.rm(name, recursive=True)

