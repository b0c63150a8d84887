"""``...checkpointing.local.base_state_dict`` (see :mod:`ckpt_client.local.tensor_aware`)."""

from ckpt_client.local.tensor_aware import TensorAwareStateDict

__all__ = ["TensorAwareStateDict"]
