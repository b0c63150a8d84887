"""A shared file mapping at a 2 MiB-aligned address, so that huge pages map as such.

Owns :class:`AlignedMapping`. The kernel maps a file's 2 MiB page with one page-table
entry (and pins it for a direct write with one reference instead of 512) only where the
mapping's addresses are 2 MiB-aligned with the file's offsets. A tmpfs mounted with huge
pages aligns mappings of its files by itself; a pool in ``/dev/shm`` whose pages are
folded into huge ones after it was mapped (:mod:`ckptd.staging.collapse`) does not, so
its mappers ask for the alignment here: a ``PROT_NONE`` reservation one huge page larger
than the file, with the file mapped over it at the first aligned address. On 4 KiB pages
it costs nothing and changes nothing.

Used by the daemon's background folding and by the writers, both of which write through
the mapping's memory with ``O_DIRECT``. No sockets, no pools.
"""

from __future__ import annotations

import ctypes
import mmap

__all__ = ["HUGE_PAGE", "AlignedMapping"]

#: The huge page size mappings are aligned to (x86-64's and arm64-4K's PMD size).
HUGE_PAGE = 2 << 20

_MAP_FIXED = 0x10
_PROT_NONE = 0  # Python's mmap module names only PROT_READ, PROT_WRITE, PROT_EXEC
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


libc = _libc()


class AlignedMapping:
    """``size`` bytes of the file ``fd``, shared, readable and writable, mapped at a 2 MiB
    boundary (the descriptor may be closed afterwards).

    Attributes
    ----------
    address : int
        Where the mapping starts.
    size : int
        Its length.
    view : memoryview
        Its bytes (format ``B``). Views taken from it must be dropped before :meth:`close`:
        they do not keep the memory mapped.

    Raises
    ------
    OSError
        If the address space cannot be reserved or the file not mapped.
    """

    def __init__(self, fd: int, size: int) -> None:
        self.size = size
        self._span = size + HUGE_PAGE
        reserved = libc.mmap(None, self._span, _PROT_NONE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if reserved in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"cannot reserve {self._span} bytes of address space")
        self._reserved = reserved
        self.address = -(-reserved // HUGE_PAGE) * HUGE_PAGE
        if size and libc.mmap(self.address, size, mmap.PROT_READ | mmap.PROT_WRITE,
                              mmap.MAP_SHARED | _MAP_FIXED, fd, 0) != self.address:
            error = ctypes.get_errno()
            libc.munmap(reserved, self._span)
            raise OSError(error, f"cannot map {size} bytes of the file at a 2 MiB boundary")
        self.view = memoryview((ctypes.c_char * max(size, 1)).from_address(self.address)).cast("B")
        self.view = self.view[:size]

    def close(self) -> None:
        """Unmap (the reservation's slack too)."""
        if self._reserved is not None:
            self.view.release()
            libc.munmap(self._reserved, self._span)
            self._reserved = None
