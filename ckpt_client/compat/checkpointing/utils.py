"""``...checkpointing.utils``: state-dict helpers (see :mod:`ckpt_client.state_dicts`)."""

from ckpt_client.state_dicts import diff, preload_tensors, wrap_for_async

__all__ = ["diff", "preload_tensors", "wrap_for_async"]
