"""Reading a ckptd-written DCP checkpoint with its checksums checked.

:class:`VerifyingFileSystemReader` is stock DCP's ``FileSystemReader`` that checks every
file against the crc32 record ckptd wrote beside it before using a byte of it;
:func:`verify_checkpoint` checks a whole directory offline (what ``ckptd verify`` does).
"""

from __future__ import annotations

import os

from torch.distributed.checkpoint.filesystem import FileSystemReader as _StockReader
from torch.distributed.checkpoint.metadata import Metadata

from ckptd.checksum import verify_file, verify_tree
from ckpt_client.dcp.files import METADATA_NAME


class VerifyingFileSystemReader(_StockReader):
    """Stock DCP ``FileSystemReader`` that checks every file against its ckptd checksum.

    ``.metadata`` is verified before it is unpickled, and each data file before the
    first byte of it is used; a mismatch raises
    :class:`ckptd.checksum.ChecksumMismatchError` naming the file, so a corrupted part
    is never loaded silently.

    Parameters
    ----------
    path : str or PathLike
        Checkpoint directory.
    """

    def __init__(self, path: str | os.PathLike, *args, **kwargs) -> None:
        super().__init__(path, *args, **kwargs)
        self._verified: set[str] = set()

    def _verify(self, relative_path: str) -> None:
        if relative_path not in self._verified:
            verify_file(os.path.join(os.fspath(self.path), relative_path))
            self._verified.add(relative_path)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        """Verify, then read, ``.metadata``."""
        self._verify(METADATA_NAME)
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        """Verify every file the plan touches, then read as stock DCP does."""
        for item in plan.items:
            self._verify(self.storage_data[item.storage_index].relative_path)
        return super().read_data(plan, planner)


def verify_checkpoint(path: str | os.PathLike) -> list[str]:
    """Verify every file of a ckptd-written checkpoint directory (or single file).

    Returns
    -------
    list of str
        The files verified.

    Raises
    ------
    ckptd.checksum.ChecksumMismatchError
        On the first file whose bytes do not match its record (or that has none).
    """
    return verify_tree(os.fspath(path))
