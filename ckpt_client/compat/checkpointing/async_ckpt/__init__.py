"""``nvidia_resiliency_ext.checkpointing.async_ckpt``, served by ckpt_client (re-exports)."""

from ckpt_client.queue.calls_queue import (AsyncCallsQueue, abort_async_checkpoints,
                                           abort_nvrx_checkpoint)
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.torch_ckpt import TorchAsyncCheckpoint

__all__ = ["AsyncCallsQueue", "AsyncRequest", "TorchAsyncCheckpoint", "abort_async_checkpoints",
           "abort_nvrx_checkpoint"]
