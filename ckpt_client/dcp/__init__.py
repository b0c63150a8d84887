"""``torch.distributed.checkpoint`` (DCP) through the daemon: ``from ckpt_client import dcp``.

What users call: :func:`async_save` (plan, stage, and an ``AsyncRequest`` whose finalize
commits ``.metadata`` last), :class:`StorageWriter` for stock ``dcp.save``,
:class:`Stager` for stock ``dcp.async_save`` (the daemon stages),
:class:`VerifyingFileSystemReader` (stock reader that checks ckptd's checksums) and
:func:`verify_checkpoint`. The modules:

- :mod:`~ckpt_client.dcp.save` — ``async_save`` and its finalize step
- :mod:`~ckpt_client.dcp.planning` — local and global plans, their caches, early staging
- :mod:`~ckpt_client.dcp.plan_reuse` — reusing a local plan while the structure is unchanged
- :mod:`~ckpt_client.dcp.fast_plan` — the default planner's plans (and item data), made
  without its per-item overhead, equal to what it makes
- :mod:`~ckpt_client.dcp.plan_wire` — the plan gather and scatter, packed for those plans
- :mod:`~ckpt_client.dcp.leaf_bytes` — which small leaves may reuse an earlier save's
  ``torch.save`` bytes
- :mod:`~ckpt_client.dcp.writer` — the ``StorageWriter`` (stage, write results, finish)
- :mod:`~ckpt_client.dcp.commit` — the one ``.metadata`` commit, on the coordinator, last
- :mod:`~ckpt_client.dcp.commit_handover` — a tiered save's commit, given to the
  coordinator's daemon at staging time
- :mod:`~ckpt_client.dcp.files` — file names and which items go into which file
- :mod:`~ckpt_client.dcp.reader` — the checksum-verifying reader
- :mod:`~ckpt_client.dcp.stager` — the ``Stager`` for stock ``dcp.async_save``
- :mod:`~ckpt_client.dcp.stage_ahead` — a ``Stager``'s save staged with the remembered
  plan before DCP plans it
"""

from ckpt_client.dcp.files import (DCP_SUFFIX, METADATA_NAME, chunk_files, item_nbytes,
                                   resolve_items, split_into_files)
from ckpt_client.dcp.reader import VerifyingFileSystemReader, verify_checkpoint
from ckpt_client.dcp.save import async_save
from ckpt_client.dcp.stager import Stager
from ckpt_client.dcp.writer import DaemonStorageWriter, StorageWriter

__all__ = ["DCP_SUFFIX", "METADATA_NAME", "DaemonStorageWriter", "Stager", "StorageWriter",
           "VerifyingFileSystemReader", "async_save", "chunk_files", "item_nbytes",
           "resolve_items", "split_into_files", "verify_checkpoint"]
