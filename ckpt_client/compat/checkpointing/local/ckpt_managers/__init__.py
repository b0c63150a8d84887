"""``...checkpointing.local.ckpt_managers``, served by ckpt_client (re-exports only)."""
