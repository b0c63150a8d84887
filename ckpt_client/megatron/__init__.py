"""The reference's Megatron-style split DCP save: plan, write in the background, finalize."""
