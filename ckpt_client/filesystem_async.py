"""``ckpt_client.filesystem_async``: the reference's module path for ``FileSystemWriterAsync``.

Kept so code that imports it from here keeps working; the writer lives in
:mod:`ckpt_client.megatron.writer`. Owns no behaviour.
"""

from ckpt_client.megatron.results import WorkerFailure
from ckpt_client.megatron.writer import FileSystemWriterAsync

__all__ = ["FileSystemWriterAsync", "WorkerFailure"]
