"""Retiring a mapping of the staging pool that torch tensors view.

The daemon (its CUDA stager) and every trainer (its copier, a local checkpoint read out of
the daemon's memory) view their mapping of the pool file through ``torch.frombuffer``, and
such views outlive whoever made them: a copy still running on another thread, a cached
destination. Unmapping the pool under them would leave them pointing at nothing (a
SIGSEGV, or a heap corrupted once malloc reuses the range). Neither side unmaps the pool:
each retires it with :func:`retire_mapping`, and the range is unmapped when the last view
is gone. Both map it with :class:`ckptd.aligned_mapping.AlignedMapping`, which keeps no
descriptor of the file, so retiring also lets the file go: an unlinked pool's pages are
freed at once. Owns that one call; it must not know whose mapping it is, nor import torch.
"""

from __future__ import annotations

import ctypes
import errno
import mmap

__all__ = ["retire_mapping"]

_MAP_NORESERVE = 0x4000  # Python 3.11's mmap module does not name it
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2
_MAP_FAILED = ctypes.c_void_p(-1).value

_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]
_mremap = _libc.mremap
_mremap.restype = ctypes.c_void_p
_mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                    ctypes.c_void_p]
_munmap = _libc.munmap
_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def retire_mapping(address: int, size: int) -> int:
    """Put private anonymous memory in place of the mapping at ``[address, address + size)``,
    in one step; returns 0, or the errno of a failure (nothing changed).

    The views of the range stay valid: they read zeros from then on, and a write lands in
    a page of this process alone (committed only once touched: ``MAP_NORESERVE``), never in
    the file, whose pages are no longer mapped here.
    """
    # Made elsewhere first, then moved over the range: a MAP_FIXED straight over it may
    # unmap the range and then fail (ENOMEM under vm.overcommit_memory=2 on older kernels),
    # leaving a hole under the views; mremap fails before it unmaps anything.
    replacement = _mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if replacement in (None, _MAP_FAILED):
        return ctypes.get_errno() or errno.ENOMEM
    moved = _mremap(replacement, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved == address:
        return 0
    error = ctypes.get_errno() or errno.EIO
    _munmap(replacement, size)
    return error
