"""A shared file mapping at a huge-page-aligned address, so that huge pages map as such.

Owns :class:`AlignedMapping`. The kernel maps a file's huge page with one page-table entry
(and pins it for a direct write with one reference instead of 512) only where the
mapping's addresses are aligned with the file's offsets to the page's size. A tmpfs
mounted with huge pages aligns mappings of its files by itself; a pool in ``/dev/shm``
whose pages are folded into huge ones after it was mapped (:mod:`ckptd.staging.collapse`)
does not, so its mappers ask for the alignment here: an inaccessible reservation one
alignment larger than the file, with the file mapped over it at the first aligned
address. The alignment is the larger of the kernel's transparent huge page size
(``hpage_pmd_size``: 2 MiB on x86-64 and arm64 with 4 KiB pages) and the file's own page
size (a hugetlbfs with 1 GiB pages maps its files only at 1 GiB boundaries). On 4 KiB
pages it costs nothing and changes nothing.

The reservation is a Python :class:`mmap.mmap`, so views of the file's bytes are exports of
it: like Python's own mappings, :meth:`AlignedMapping.close` refuses (``BufferError``)
while any view is alive instead of leaving it pointing at unmapped memory. Unlike them it
keeps no descriptor of the file: the mapping alone holds the file open, so once the
mapping is gone (unmapped, or retired by :func:`retire_mapping` under live
views) an unlinked file's pages are freed and a ``flock`` held through another descriptor
ends with that descriptor.

Used by the daemon's background folding, its staging pool and its writers, and by every
trainer's mapping of the pool (a shared module: no sockets, no pools).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

__all__ = ["HUGE_PAGE", "AlignedMapping", "alignment_of", "retire_mapping", "thp_page_size"]

_PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
_FALLBACK_HUGE_PAGE = 2 << 20  # x86-64's and arm64-4K's PMD size, where sysfs does not say


def thp_page_size(path: str = _PMD_SIZE_FILE) -> int:
    """The kernel's transparent huge page size (2 MiB where it does not say)."""
    try:
        with open(path) as f:
            size = int(f.read().strip())
    except (OSError, ValueError):
        return _FALLBACK_HUGE_PAGE
    return size if size > 0 and size & (size - 1) == 0 else _FALLBACK_HUGE_PAGE


#: The transparent huge page size: what tmpfs pages are folded into.
HUGE_PAGE = thp_page_size()

_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000  # Python 3.11's mmap module names neither
_PROT_NONE = 0  # Python's mmap module names only PROT_READ, PROT_WRITE, PROT_EXEC
_MAP_FAILED = ctypes.c_void_p(-1).value
_MREMAP_MAYMOVE = 1
_MREMAP_FIXED = 2


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int,
                            ctypes.c_void_p]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


libc = _libc()


def alignment_of(fd: int) -> int:
    """The boundary the file ``fd`` is mapped at: the transparent huge page size, or the
    file's own page size where that is larger (``f_bsize`` of a hugetlbfs is its page size;
    of a tmpfs or disk filesystem 4 KiB)."""
    try:
        page = os.fstatvfs(fd).f_bsize
    except OSError:
        page = 0
    return max(HUGE_PAGE, page)


def _size_text(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} bytes"


def _what_to_do(error: int, alignment: int) -> str:
    if error == errno.ENOMEM and alignment > HUGE_PAGE:
        return (f"the file is on a hugetlbfs with {_size_text(alignment)} pages and too few are "
                f"free: reserve more (/sys/kernel/mm/hugepages/hugepages-{alignment >> 10}kB/"
                "nr_hugepages; HugePages_Free in /proc/meminfo) or use a smaller pool")
    if error in (errno.EACCES, errno.EBADF):
        return "the file must be opened read-write by its owner"
    if error == errno.ENOMEM:
        return "the process is out of address space or memory (ulimit -v, vm.max_map_count)"
    return ("check that the file is on a tmpfs or hugetlbfs and its size is a multiple of its "
            "page size")


class AlignedMapping:
    """``size`` bytes of the file ``fd``, shared, readable and writable, mapped at a boundary
    of :func:`alignment_of` (the descriptor may be closed afterwards).

    Parameters
    ----------
    fd : int
        The file, open read-write.
    size : int
        Bytes to map from its start.
    path : str, optional
        The file's name, for error messages.
    populate : bool
        Fault every page in now (``MAP_POPULATE``).

    Attributes
    ----------
    address : int
        Where the mapping starts.
    size : int
        Its length.
    alignment : int
        The boundary ``address`` is a multiple of.
    view : memoryview
        Its bytes (format ``B``). Views taken from it keep :meth:`close` from unmapping.

    Raises
    ------
    OSError
        If the address space cannot be reserved or the file not mapped; the message names
        the file, the alignment, the errno and what to do.
    """

    def __init__(self, fd: int, size: int, path: str | None = None, *,
                 populate: bool = False) -> None:
        self.size = size
        self.alignment = alignment_of(fd)
        where = path or f"descriptor {fd}"
        span = size + self.alignment
        # Python's mmap exports writable views only of a writable mapping; the range is
        # then mapped again inaccessible, so that its slack is neither usable nor counted
        # against the commit limit, and the file over it
        try:
            self._reservation = mmap.mmap(
                -1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot reserve {span} bytes of address space to map "
                          f"{where}: {exc.strerror} (errno {exc.errno}); "
                          f"{_what_to_do(exc.errno, HUGE_PAGE)}") from None
        reserved = ctypes.addressof(ctypes.c_char.from_buffer(self._reservation))
        libc.mmap(reserved, span, _PROT_NONE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED, -1, 0)
        self.address = -(-reserved // self.alignment) * self.alignment
        self._offset = self.address - reserved
        flags = mmap.MAP_SHARED | _MAP_FIXED | (mmap.MAP_POPULATE if populate else 0)
        if size and libc.mmap(self.address, size, mmap.PROT_READ | mmap.PROT_WRITE, flags,
                              fd, 0) != self.address:
            error = ctypes.get_errno() or errno.EIO
            self._reservation.close()
            raise OSError(error, f"cannot map {size} bytes of {where} at a "
                          f"{_size_text(self.alignment)} boundary: {os.strerror(error)} "
                          f"(errno {error}); {_what_to_do(error, self.alignment)}")
        self.view = self._export()

    def _export(self) -> memoryview:
        with memoryview(self._reservation) as whole:
            return whole[self._offset:self._offset + self.size]

    def close(self) -> None:
        """Unmap (the reservation's slack too); a second call does nothing.

        Raises
        ------
        BufferError
            If views of the mapping are still alive (it stays mapped; drop them first).
        """
        if self._reservation.closed:
            return
        self.view.release()
        try:
            self._reservation.close()
        except BufferError:
            self.view = self._export()
            raise BufferError(f"cannot unmap the {self.size}-byte mapping at {self.address:#x}: "
                              "views of it are still alive; release them first") from None


def retire_mapping(address: int, size: int) -> int:
    """Put private anonymous memory in place of the mapping at ``[address, address + size)``,
    in one step; returns 0, or the errno of a failure (nothing changed).

    The views of the range stay valid: they read zeros from then on, and a write lands in
    a page of this process alone (committed only once touched: ``MAP_NORESERVE``), never in
    the file, whose pages are no longer mapped here. Neither the daemon nor a trainer
    unmaps the pool: ``torch.frombuffer`` views of it keep no buffer export, so an unmap
    under them would leave them pointing at nothing (a SIGSEGV, or a heap corrupted once
    malloc reuses the range); the range is unmapped when the last view is gone.
    """
    # Made elsewhere first, then moved over the range: a MAP_FIXED straight over it may
    # unmap the range and then fail (ENOMEM under vm.overcommit_memory=2 on older kernels),
    # leaving a hole under the views; mremap fails before it unmaps anything.
    replacement = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE,
                            mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if replacement in (None, _MAP_FAILED):
        return ctypes.get_errno() or errno.ENOMEM
    moved = libc.mremap(replacement, size, size, _MREMAP_MAYMOVE | _MREMAP_FIXED, address)
    if moved == address:
        return 0
    error = ctypes.get_errno() or errno.EIO
    libc.munmap(replacement, size)
    return error
