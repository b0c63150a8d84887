"""Which kind of filesystem holds a path or an open file: ``statfs``'s type, which
``os.statvfs`` does not give.

Owns the filesystem magic numbers the daemon decides by (a staging pool must be on tmpfs
or hugetlbfs; allocating ahead does not pay on tmpfs; a dropped file's data may be freed
late only where the kernel frees it in place) and the one call that reads them; it
decides nothing itself.
"""

from __future__ import annotations

import ctypes
import os

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
EXT4_MAGIC = 0xEF53  # ext2 and ext3 too
XFS_MAGIC = 0x58465342
BTRFS_MAGIC = 0x9123683E

_libc = ctypes.CDLL(None, use_errno=True)


def statfs(target: str | int) -> tuple[int, int]:
    """``(f_type, f_bsize)`` of the filesystem holding ``target`` (a path or a descriptor).

    Raises
    ------
    OSError
        If the kernel refuses (the path is gone, the descriptor closed).
    """
    buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if isinstance(target, int):
        failed = _libc.fstatfs(target, buf) != 0
    else:
        failed = _libc.statfs(os.fsencode(target), buf) != 0
    if failed:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    words = ctypes.cast(buf, ctypes.POINTER(ctypes.c_long))
    return words[0] & 0xFFFFFFFF, words[1]
