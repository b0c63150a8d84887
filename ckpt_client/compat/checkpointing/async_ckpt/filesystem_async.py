"""``...checkpointing.async_ckpt.filesystem_async``: the asynchronous DCP writer (see
:mod:`ckpt_client.megatron.writer`)."""

from ckpt_client.megatron.results import WorkerFailure
from ckpt_client.megatron.writer import FileSystemWriterAsync

__all__ = ["FileSystemWriterAsync", "WorkerFailure"]
