"""Retiring a mapping of the staging pool that torch tensors view.

The daemon (its CUDA stager) and every trainer (its copier, a local checkpoint read out of
the daemon's memory) view their mapping of the pool file through ``torch.frombuffer``,
which keeps no buffer export, only a reference to the ``mmap`` object: ``mmap.close()``
succeeds under such views and unmaps memory they still point at (a SIGSEGV, or a heap
corrupted once malloc reuses the range). Neither side unmaps the pool: each retires it
with :func:`retire_mapping` and drops its ``mmap`` object, which Python unmaps when the last
view is gone. Owns that one call; it must not know whose mapping it is, nor import torch.
"""

from __future__ import annotations

import ctypes
import errno
import mmap

__all__ = ["retire_mapping"]

_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000  # Python 3.11's mmap module names neither

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]


def retire_mapping(address: int, size: int) -> int:
    """Put private anonymous memory in place of the mapping at ``[address, address + size)``,
    in one step (``MAP_FIXED``); returns 0, or the errno of a failure (nothing changed).

    The views of the range stay valid: they read zeros from then on, and a write lands in
    a page of this process alone (committed only once touched: ``MAP_NORESERVE``), never in
    the file, whose pages are no longer mapped here.
    """
    replaced = _mmap(address, size, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE, -1, 0)
    return 0 if replaced == address else ctypes.get_errno() or errno.EIO
