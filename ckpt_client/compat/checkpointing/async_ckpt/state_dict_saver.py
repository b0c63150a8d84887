"""``...checkpointing.async_ckpt.state_dict_saver``: plan, write, finalize, with the
metadata cache (see :mod:`ckpt_client.megatron.saver`)."""

from ckpt_client.megatron.saver import (CheckpointMetadataCache, get_metadata_caching_status,
                                          init_checkpoint_metadata_cache,
                                          save_state_dict_async_finalize,
                                          save_state_dict_async_plan)

__all__ = ["CheckpointMetadataCache", "get_metadata_caching_status",
           "init_checkpoint_metadata_cache", "save_state_dict_async_finalize",
           "save_state_dict_async_plan"]
