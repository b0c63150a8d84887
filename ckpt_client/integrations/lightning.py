"""PyTorch Lightning: a ``CheckpointIO`` plugin whose files the node's ckptd writes.

``Trainer(plugins=[CkptdCheckpointIO()])``: ``save_checkpoint`` hands Lightning's
checkpoint dict to the daemon and returns once it is staged (the training step goes on
while the daemon writes, fsyncs and renames); ``load_checkpoint`` and
``remove_checkpoint`` (``ModelCheckpoint``'s ``save_top_k`` rotation) never act on a
checkpoint that is not durable: a load first waits for the saves in flight, and a removal
is deferred until they are durable (without blocking the training step), so a crash
while the newest save is being written still finds the checkpoints rotation would have
removed; ``teardown`` drains and carries out the deferred removals. The files are plain
``torch.save`` files: stock Lightning (``TorchCheckpointIO``) and ``torch.load`` read
them.

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

from ckpt_client import TorchAsyncCheckpoint  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptdCheckpointIO"]


class CkptdCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through ckptd.

    Parameters
    ----------
    socket : str, optional
        Daemon socket (see :func:`ckpt_client.connect`; default ``CKPTD_SOCKET`` or the
        auto-started node daemon).
    """

    def __init__(self, socket: str | None = None) -> None:
        super().__init__()
        self._socket = socket
        self._checkpoint: TorchAsyncCheckpoint | None = None
        self._in_flight: set[str] = set()
        self._removals: list[str] = []
        self._fallback = TorchCheckpointIO()

    @property
    def _async(self) -> TorchAsyncCheckpoint:
        if self._checkpoint is None:
            self._checkpoint = TorchAsyncCheckpoint(socket=self._socket)
        return self._checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any = None) -> None:
        """Hand ``checkpoint`` to the daemon; return once it is staged.

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
            if self._checkpoint is not None:
                self._checkpoint.close()
                self._checkpoint = None

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

