"""ckpt_client: the trainer side of ckptd.

Save through the node's daemon and finalize across ranks. Names mirror NVIDIA's
resiliency extension so existing code can switch::

    from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint
    from ckpt_client import dcp  # dcp.async_save(...), dcp.StorageWriter
    from ckpt_client import guard_optimizer  # zero-stall saves: wait before the step

Reference module paths (``nvidia_resiliency_ext.checkpointing...``) are served under
``ckpt_client.compat``; ``docs/migrating.md`` maps every name.

The tree: :mod:`~ckpt_client.transport` (connection, staging into the daemon's pool,
CUDA IPC), :mod:`~ckpt_client.queue` (``AsyncRequest``, ``AsyncCallsQueue``, runners),
the front-ends :mod:`~ckpt_client.torch_ckpt`, :mod:`~ckpt_client.dcp`,
:mod:`~ckpt_client.megatron` and :mod:`~ckpt_client.local`; :mod:`~ckpt_client.collectives`
(every torch.distributed call) and :mod:`~ckpt_client.errors` beside them.

Imports only ``ckptd.protocol``, ``ckptd.checksum`` and ``ckptd.knobs`` from the daemon
package (the shared wire, file and tuning contracts; their ``__all__``), never its
internals.
"""

from ckpt_client import dcp
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.local import (BasicTensorAwareStateDict, CliqueReplicationStrategy,
                               LocalCheckpointManager)
from ckpt_client.local.tensor_aware import TensorAwareStateDict
from ckpt_client.megatron.saver import (CheckpointMetadataCache, init_checkpoint_metadata_cache,
                                        save_state_dict_async_finalize, save_state_dict_async_plan)
from ckpt_client.megatron.writer import FileSystemWriterAsync
from ckpt_client.queue.calls_queue import (AsyncCallsQueue, abort_async_checkpoints,
                                           abort_nvrx_checkpoint)
from ckpt_client.queue.guard import guard_optimizer
from ckpt_client.queue.request import AsyncRequest
from ckpt_client.state_dicts import preload_tensors, wrap_for_async
from ckpt_client.torch_ckpt import TorchAsyncCheckpoint, async_torch_save
from ckpt_client.transport.connection import DaemonConnection, connect

__all__ = [
    "AsyncCallsQueue", "AsyncRequest", "BasicTensorAwareStateDict", "CheckpointException",
    "CheckpointMetadataCache", "CliqueReplicationStrategy", "DaemonConnection",
    "DaemonRequestError", "DaemonUnavailableError", "FileSystemWriterAsync",
    "LocalCheckpointManager", "TensorAwareStateDict", "TorchAsyncCheckpoint",
    "abort_async_checkpoints", "abort_nvrx_checkpoint", "async_torch_save", "connect",
    "guard_optimizer",
    "init_checkpoint_metadata_cache", "preload_tensors", "save_state_dict_async_finalize",
    "save_state_dict_async_plan", "wrap_for_async",
]
