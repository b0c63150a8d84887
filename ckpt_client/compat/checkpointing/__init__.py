"""``nvidia_resiliency_ext.checkpointing``, served by ckpt_client (re-exports only)."""
