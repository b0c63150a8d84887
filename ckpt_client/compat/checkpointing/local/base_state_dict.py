"""``...checkpointing.local.base_state_dict`` (see :mod:`ckpt_client.tensor_aware`)."""

from ckpt_client.tensor_aware import TensorAwareStateDict

__all__ = ["TensorAwareStateDict"]
