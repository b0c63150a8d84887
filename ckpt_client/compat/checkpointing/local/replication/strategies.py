"""``...checkpointing.local.replication.strategies`` (see :mod:`ckpt_client.local`)."""

from ckpt_client.local import CliqueReplicationStrategy

__all__ = ["CliqueReplicationStrategy"]
