"""Adapters that put ckptd under the frameworks people train with.

One module per framework, each an optional extra of the ``ckptd`` package:

- :mod:`ckpt_client.integrations.lightning`: ``CkptdCheckpointIO``, a Lightning
  ``CheckpointIO`` plugin (``pip install 'ckptd[lightning]'``);
- :mod:`ckpt_client.integrations.torchtitan`: ``CkptdCheckpointManager``, torchtitan's
  checkpoint manager saving through ``torch.distributed.checkpoint.async_save`` with
  ckptd's writer and stager (``[torchtitan]``);
- :mod:`ckpt_client.integrations.hf`: Accelerate ``save_state`` / ``load_state`` and a
  Transformers ``TrainerCallback`` (``[hf]``).

Importing one of them checks that the framework is installed and that its version is in
the range CI tests; this package itself imports no framework.
"""

from ckpt_client.integrations.versions import UnsupportedFrameworkError, require

__all__ = ["UnsupportedFrameworkError", "require"]
