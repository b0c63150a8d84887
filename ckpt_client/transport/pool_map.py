"""This process's mapping of the daemon's staging pool: made once per connection, retired
when the connection closes.

Owns the mapping's life in the trainer. Its views are torch tensors that outlive the
connection's own reference: the copier's cached destinations, a zero-stall copy still
running on another thread when :func:`~ckpt_client.transport.connection.connect` closes a
dead daemon's connection, a local checkpoint read out of the daemon's memory. So the
mapping is never closed (it would be unmapped under them,
:func:`ckptd.aligned_mapping.retire_mapping`) but retired: the daemon's pages leave this process at
once, the views go on reading zeros, and the range is unmapped with the last of them. It
must not know about connections or saves.
"""

from __future__ import annotations

import logging
import os

from ckptd.aligned_mapping import AlignedMapping, retire_mapping

log = logging.getLogger(__name__)


def map_pool(path: str, size: int):
    """The pool file ``path`` mapped shared, as a flat ``torch.uint8`` tensor of ``size``
    bytes (the tensor keeps the mapping alive, and nothing else keeps the file open: once
    the mapping is retired, a pool its daemon unlinked is freed)."""
    import torch

    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        mapping = AlignedMapping(fd, size, path, populate=True)
    finally:
        os.close(fd)
    return torch.frombuffer(mapping.view, dtype=torch.uint8)


def retire_pool(pool, path: str) -> None:
    """Take the daemon's pages away from ``pool`` (a :func:`map_pool` tensor, or ``None``:
    never mapped) and from every view of it, unmapping nothing: a copy still running
    writes into pages of this process alone."""
    if pool is None:
        return
    error = retire_mapping(pool.data_ptr(), pool.numel())
    if error:
        # Unmapping would leave live views pointing at nothing: the pool's pages stay
        # mapped (and views may still change them) until the last view is gone.
        log.warning("the staging pool %s stays mapped until its last view is dropped: "
                    "replacing it failed: %s (errno %d)", path, os.strerror(error), error)
