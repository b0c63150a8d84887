"""``...checkpointing.local.replication``, served by ckpt_client (re-exports only)."""
