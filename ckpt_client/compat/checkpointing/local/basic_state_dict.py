"""``...checkpointing.local.basic_state_dict`` (see :mod:`ckpt_client.local`)."""

from ckpt_client.local import BasicTensorAwareStateDict
from ckpt_client.local.tensor_aware import TensorPlaceholder

__all__ = ["BasicTensorAwareStateDict", "TensorPlaceholder"]
