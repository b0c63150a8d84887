"""``torch.distributed.checkpoint`` (DCP) through the daemon: ``from ckpt_client import dcp``.

What users call: :func:`async_save` (plan, stage, and an ``AsyncRequest`` whose finalize
commits ``.metadata`` last), :class:`StorageWriter` for stock ``dcp.save``,
:class:`Stager` for stock ``dcp.async_save`` (the daemon stages),
:class:`VerifyingFileSystemReader` (stock reader that checks ckptd's checksums) and
:func:`verify_checkpoint`.
"""

from ckpt_client.dcp.stager import Stager
from ckpt_client.dcp.writer import (DCP_SUFFIX, METADATA_NAME, DaemonStorageWriter, StorageWriter,
                                    VerifyingFileSystemReader, async_save, chunk_files,
                                    item_nbytes, resolve_items, split_into_files,
                                    verify_checkpoint)

__all__ = ["DCP_SUFFIX", "METADATA_NAME", "DaemonStorageWriter", "Stager", "StorageWriter",
           "VerifyingFileSystemReader", "async_save", "chunk_files", "item_nbytes",
           "resolve_items", "split_into_files", "verify_checkpoint"]
