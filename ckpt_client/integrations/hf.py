"""Hugging Face: Transformers ``Trainer`` checkpoints and Accelerate state through ckptd.

Transformers: :class:`CkptdTrainer` is ``Trainer`` with the smallest override that makes
checkpoint saves asynchronous. In ``checkpoint-N`` the model weights
(``pytorch_model.bin``), ``optimizer.pt`` and ``scheduler.pt`` are handed to the daemon
and training goes on once they are staged; the small files (``config.json``,
``trainer_state.json``) and ``rng_state.pth`` (it holds numpy and Python RNG state,
which ckptd's format cannot store without pickling) stay ``Trainer``'s own synchronous
writes. When every file of ``checkpoint-N`` is durable, the adapter writes the marker
``ckptd-complete`` into it (through the daemon: temp, fsync, rename) and only then runs
``save_total_limit`` rotation, so rotation never deletes a checkpoint while a newer one
is not durable yet. ``train(resume_from_checkpoint=True)`` resumes from the newest
*complete* checkpoint (stock ``Trainer`` would take the newest directory, even one a
crash left half-written). Under DDP the rank that saves (``should_save``) hands its
files to the daemon and every rank writes its own ``rng_state_R.pth``; the marker comes
only after all ranks wrote theirs. Under DeepSpeed or FSDP the adapter steps aside and
``Trainer`` saves as usual.

Accelerate: :func:`save_state` / :func:`load_state` wrap ``Accelerator.save_state`` /
``load_state``: the models' weights go through the daemon (``pytorch_model*.bin``, from
the process Accelerate saves on; the rest, optimizer and RNG included, is Accelerate's
own writer), and ``load_state`` waits, on every process, until they are durable first.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

from ckpt_client.integrations.versions import require

require("transformers")

import torch  # noqa: E402
from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints  # noqa: E402
from transformers.utils import WEIGHTS_NAME  # noqa: E402

from ckptd.protocol import CommitFile, MessageType, resolve_socket_path  # noqa: E402
from ckpt_client import connect  # noqa: E402
from ckpt_client import TorchAsyncCheckpoint  # noqa: E402
from ckpt_client.transport import waits  # noqa: E402

log = logging.getLogger(__name__)

__all__ = ["CkptdTrainer", "COMPLETE_MARKER", "last_complete_checkpoint", "load_state",
           "save_state"]

#: Written (durably, last) into a ``checkpoint-N`` once all its files are durable.
COMPLETE_MARKER = "ckptd-complete"
OPTIMIZER_NAME, SCHEDULER_NAME = "optimizer.pt", "scheduler.pt"
_CHECKPOINT = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def last_complete_checkpoint(output_dir: str | os.PathLike) -> str | None:
    """The newest ``checkpoint-N`` under ``output_dir`` that has the complete marker."""
    output_dir = os.fspath(output_dir)
    if not os.path.isdir(output_dir):
        return None
    steps = [(int(m.group(1)), name) for name in os.listdir(output_dir)
             if (m := _CHECKPOINT.match(name))
             and os.path.exists(os.path.join(output_dir, name, COMPLETE_MARKER))]
    return os.path.join(output_dir, max(steps)[1]) if steps else None


def _commit_marker(directory: str, socket: str | None) -> None:
    connection = connect(socket)
    connection.call(MessageType.COMMIT_FILE,
                    CommitFile(path=os.path.join(directory, COMPLETE_MARKER)),
                    frames=[b"complete\n"],
                    timeout=waits.commit_file(connection.deadlines, connection.tiered))


class _Pending:
    """The checkpoint being written: its directory, run directory and rotation limit."""

    def __init__(self, directory: str, run_dir: str, limit: int | None) -> None:
        self.directory, self.run_dir, self.limit = directory, run_dir, limit


class _CommitWhenDurable(TrainerCallback):
    """Commits finished checkpoints at step ends (without waiting) and at train end."""

    def __init__(self, trainer: "CkptdTrainer") -> None:
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.commit_checkpoints(blocking=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer.commit_checkpoints(blocking=True)


class CkptdTrainer(Trainer):
    """``transformers.Trainer`` whose checkpoints are written by the node's ckptd.

    Takes ``Trainer``'s arguments, plus ``ckptd_socket`` (default ``CKPTD_SOCKET`` or the
    auto-started node daemon). See the module docstring for what goes through the daemon.
    """

    def __init__(self, *args: Any, ckptd_socket: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ckptd_socket = ckptd_socket
        self._ckptd = TorchAsyncCheckpoint(socket=ckptd_socket)
        self._ckptd_pending: _Pending | None = None
        self._ckptd_saving: str | None = None  # "checkpoint-N" while Trainer saves it
        self._ckptd_directory: str | None = None
        self.add_callback(_CommitWhenDurable(self))

    # -------------------------------------------------------------- overrides
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        """As ``Trainer.train``; ``resume_from_checkpoint=True`` means the newest complete
        checkpoint of ``args.output_dir``."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                # Stock Trainer's words (code that matches on them keeps working), then ours.
                raise ValueError(f"No valid checkpoint found in output directory "
                                 f"({self.args.output_dir}): no checkpoint-N in it has the "
                                 f"{COMPLETE_MARKER} marker ckptd writes once every file of "
                                 f"a checkpoint is durable")
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _save_checkpoint(self, model, trial) -> None:
        if not self._through_daemon():
            return super()._save_checkpoint(model, trial)
        if self.args.should_save:
            self._hand_checkpoint_to_daemon(model, trial)
        else:  # another DDP rank: Trainer writes only its rng_state_<rank>.pth
            super()._save_checkpoint(model, trial)
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            # Every rank's own files are written before the saving rank may mark the
            # checkpoint complete (it does so at a later step end, or at train end).
            torch.distributed.barrier()

    def _hand_checkpoint_to_daemon(self, model, trial) -> None:
        self.commit_checkpoints(blocking=True)  # one checkpoint in flight at a time
        limit, self.args.save_total_limit = self.args.save_total_limit, None
        # Trainer names the directory (its run directory depends on the trial); the
        # overrides below see it and note it.
        self._ckptd_saving = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        self._ckptd_directory = None
        try:  # rotation waits until this checkpoint is durable: commit_checkpoints runs it
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit, self._ckptd_saving = limit, None
        directory = self._ckptd_directory
        if directory is not None:
            self._ckptd_pending = _Pending(directory, os.path.dirname(directory), limit)

    def _is_checkpoint_directory(self, output_dir: str | None) -> bool:
        if self._ckptd_saving is None or output_dir is None \
                or os.path.basename(os.path.normpath(output_dir)) != self._ckptd_saving:
            return False
        self._ckptd_directory = output_dir
        return True

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._is_checkpoint_directory(output_dir) or not hasattr(self.model, "config"):
            return super()._save(output_dir, state_dict)
        os.makedirs(output_dir, exist_ok=True)
        self.model.config.save_pretrained(output_dir)
        if getattr(self.model, "generation_config", None) is not None \
                and self.model.can_generate():
            self.model.generation_config.save_pretrained(output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        weights = state_dict if state_dict is not None else self.model.state_dict()
        self._ckptd.async_save(weights, os.path.join(output_dir, WEIGHTS_NAME))
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._is_checkpoint_directory(output_dir):
            return super()._save_optimizer_and_scheduler(output_dir)
        self._ckptd.async_save(self.optimizer.state_dict(), os.path.join(output_dir, OPTIMIZER_NAME))
        self._ckptd.async_save(self.lr_scheduler.state_dict(),
                               os.path.join(output_dir, SCHEDULER_NAME))

    # -------------------------------------------------------------- committing
    def commit_checkpoints(self, blocking: bool) -> None:
        """Mark the checkpoint in flight complete once durable, then rotate.

        Raises
        ------
        ckpt_client.CheckpointException
            If one of its files failed (it is then never marked complete).
        """
        pending = self._ckptd_pending
        if pending is None:
            return
        self._ckptd.finalize_async_save(blocking=blocking, no_dist=True)
        if not blocking and self._ckptd.get_num_unfinalized_calls():
            return
        self._ckptd_pending = None
        _commit_marker(pending.directory, self._ckptd_socket)
        rotate_checkpoints(output_dir=pending.run_dir, save_total_limit=pending.limit,
                           best_model_checkpoint=self.state.best_model_checkpoint,
                           use_mtime=True)

    def _through_daemon(self) -> bool:
        # Sharded saves have their own writers and collectives; under DDP the ranks
        # that save (``should_save``) hand their files to the daemon.
        return not self.is_deepspeed_enabled and not self.is_fsdp_enabled


# ---------------------------------------------------------------------- Accelerate
def save_state(accelerator, output_dir: str | None = None, socket: str | None = None,
               **kwargs: Any) -> str:
    """``accelerator.save_state(output_dir)`` with the models' weights written by ckptd.

    Returns once the weights are staged (Accelerate writes the rest synchronously). Call
    :func:`wait_until_durable` (or :func:`load_state`) before relying on the files.
    ``output_dir`` may be left out under ``ProjectConfiguration(automatic_checkpoint_naming=True)``,
    as with Accelerate; when its ``total_limit`` makes ``save_state`` delete the oldest
    checkpoints, the saves in flight are made durable first, so rotation never deletes
    a directory the daemon is still writing into.

    Raises
    ------
    ckpt_client.CheckpointException
        If an earlier save this Accelerator handed over failed (rotation would have
        started from it).
    """
    require("accelerate")
    checkpoint = _accelerate_checkpoint(socket)
    configuration = accelerator.project_configuration
    if configuration.automatic_checkpoint_naming and configuration.total_limit is not None:
        checkpoint.finalize_async_save(blocking=True, no_dist=True)

    def hand_weights_to_daemon(models, weights, directory):
        if not _saves_here(accelerator):
            return  # Accelerate writes the weights from one process (per node) only
        os.makedirs(directory, exist_ok=True)
        for index in range(len(weights) - 1, -1, -1):
            name = WEIGHTS_NAME if index == 0 else WEIGHTS_NAME.replace(".bin", f"_{index}.bin")
            checkpoint.async_save(weights.pop(index), os.path.join(directory, name))

    handle = accelerator.register_save_state_pre_hook(hand_weights_to_daemon)
    try:
        return accelerator.save_state(output_dir, **kwargs)
    finally:
        handle.remove()


def wait_until_durable(accelerator, socket: str | None = None) -> None:
    """Return once every weight file :func:`save_state` handed over in this process (by
    this or an earlier Accelerator) is durable.

    Raises
    ------
    ckpt_client.CheckpointException
        If one of them failed (naming the file and errno).
    """
    _accelerate_checkpoint(socket).finalize_async_save(blocking=True, no_dist=True)


def load_state(accelerator, input_dir: str | None = None, socket: str | None = None,
               **kwargs: Any) -> None:
    """Wait until saves in flight are durable, then ``accelerator.load_state(input_dir)``
    and load the weights :func:`save_state` wrote (``input_dir`` left out: the newest
    checkpoint of automatic naming, as Accelerate picks it)."""
    require("accelerate")
    wait_until_durable(accelerator, socket)
    # The weights may have been handed over by another process: wait until it, too,
    # knows they are durable.
    accelerator.wait_for_everyone()

    def load_weights(models, directory):
        for index in range(len(models) - 1, -1, -1):
            name = WEIGHTS_NAME if index == 0 else WEIGHTS_NAME.replace(".bin", f"_{index}.bin")
            state = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True)
            accelerator.unwrap_model(models.pop(index)).load_state_dict(state)

    handle = accelerator.register_load_state_pre_hook(load_weights)
    try:
        accelerator.load_state(input_dir, **kwargs)
    finally:
        handle.remove()


def _saves_here(accelerator) -> bool:
    # where Accelerate's own ``save`` writes: the main process, or each node's with
    # ``save_on_each_node``
    if accelerator.project_configuration.save_on_each_node:
        return accelerator.is_local_main_process
    return accelerator.is_main_process


#: The saves in flight of every Accelerator of this process, one queue per daemon: a load
#: must wait for them all, since a loop restarted in the same process builds a new
#: Accelerator and loads what the previous one may still be writing. Keyed by the resolved
#: socket path, so ``socket=None`` and the same path given explicitly share one queue.
_ACCELERATE_CHECKPOINTS: dict[str, TorchAsyncCheckpoint] = {}


def _accelerate_checkpoint(socket: str | None) -> TorchAsyncCheckpoint:
    path = resolve_socket_path(socket)
    checkpoint = _ACCELERATE_CHECKPOINTS.get(path)
    if checkpoint is None:
        # built with the caller's own argument: connect() starts a daemon by itself
        # only when no socket was configured
        checkpoint = _ACCELERATE_CHECKPOINTS[path] = TorchAsyncCheckpoint(socket=socket)
    return checkpoint
