"""ckpt_client: the trainer side of ckptd.

Save through the node's daemon and finalize across ranks. Names mirror NVIDIA's
resiliency extension so existing code can switch::

    from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint
    from ckpt_client import dcp  # dcp.async_save(...), dcp.StorageWriter

Imports only ``ckptd.protocol`` and ``ckptd.checksum`` from the daemon package (the
shared wire and file contracts), never its internals.
"""

from ckpt_client.async_queue import AsyncCallsQueue, AsyncRequest
from ckpt_client.connection import DaemonConnection, connect
from ckpt_client.errors import CheckpointException, DaemonRequestError, DaemonUnavailableError
from ckpt_client.local import (BasicTensorAwareStateDict, CliqueReplicationStrategy,
                               LocalCheckpointManager)
from ckpt_client.torch_ckpt import TorchAsyncCheckpoint, async_torch_save

__all__ = [
    "AsyncCallsQueue", "AsyncRequest", "BasicTensorAwareStateDict", "CheckpointException",
    "CliqueReplicationStrategy", "LocalCheckpointManager", "DaemonConnection",
    "DaemonRequestError", "DaemonUnavailableError", "TorchAsyncCheckpoint",
    "async_torch_save", "connect",
]
