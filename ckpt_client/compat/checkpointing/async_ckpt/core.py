"""``...checkpointing.async_ckpt.core``: the async request queue (see
:mod:`ckpt_client.queue.calls_queue`)."""

from ckpt_client.queue.calls_queue import (AsyncCallsQueue, abort_async_checkpoints,
                                           abort_nvrx_checkpoint)
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.errors import CheckpointException

__all__ = ["AsyncCallsQueue", "AsyncRequest", "CheckpointException", "abort_async_checkpoints",
           "abort_nvrx_checkpoint"]
