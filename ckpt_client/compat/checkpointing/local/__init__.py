"""``...checkpointing.local``: local checkpoints, served by ckpt_client (re-exports only)."""
