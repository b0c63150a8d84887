"""``...checkpointing.async_ckpt.torch_ckpt``: asynchronous ``torch.save`` (see
:mod:`ckpt_client.torch_ckpt`)."""

from ckpt_client.torch_ckpt import TorchAsyncCheckpoint

__all__ = ["TorchAsyncCheckpoint"]
