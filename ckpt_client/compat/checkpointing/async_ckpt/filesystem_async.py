"""``...checkpointing.async_ckpt.filesystem_async``: the asynchronous DCP writer (see
:mod:`ckpt_client.filesystem_async`)."""

from ckpt_client.filesystem_async import FileSystemWriterAsync, WorkerFailure

__all__ = ["FileSystemWriterAsync", "WorkerFailure"]
