"""``ckpt_client.state_dict_saver``: the reference's module path for the split DCP save.

Kept so code that imports it from here keeps working (``docs/migrating.md`` names it);
the functions live in :mod:`ckpt_client.megatron.saver`. Owns no behaviour.
"""

from ckpt_client.megatron.saver import (CheckpointMetadataCache, SaveGroup,
                                        get_metadata_caching_status,
                                        init_checkpoint_metadata_cache,
                                        save_state_dict_async_finalize,
                                        save_state_dict_async_plan)

__all__ = ["CheckpointMetadataCache", "SaveGroup", "get_metadata_caching_status",
           "init_checkpoint_metadata_cache", "save_state_dict_async_finalize",
           "save_state_dict_async_plan"]
