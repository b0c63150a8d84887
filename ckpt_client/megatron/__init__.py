"""The reference's Megatron-style split DCP save: plan now, write in the background, finalize.

Code written for NVIDIA's resiliency extension or Megatron-LM's ``async_utils`` imports
these under the reference's paths (``ckpt_client.filesystem_async``,
``ckpt_client.state_dict_saver``, ``ckpt_client.compat...``). The modules:

- :mod:`~ckpt_client.megatron.writer` — ``FileSystemWriterAsync``: resolve, decide the
  files, stage, commit
- :mod:`~ckpt_client.megatron.write_runners` — how its save function runs (the daemon
  writes, or a helper process through a custom ``open_file``)
- :mod:`~ckpt_client.megatron.results` — write results and wrapped worker failures
- :mod:`~ckpt_client.megatron.saver` — ``save_state_dict_async_plan`` / ``_finalize`` and
  the metadata cache
"""
