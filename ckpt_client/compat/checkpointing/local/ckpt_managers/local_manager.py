"""``...checkpointing.local.ckpt_managers.local_manager`` (see :mod:`ckpt_client.local`)."""

from ckpt_client.local import CkptID, LocalCheckpointManager

__all__ = ["CkptID", "LocalCheckpointManager"]
