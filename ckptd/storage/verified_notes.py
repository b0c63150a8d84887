"""Notes a daemon leaves beside a local part it verified, so its successor need not read
the part again.

A daemon knows a part is intact when its writer checksummed the very bytes it wrote, a
replica's receiver checked every piece, or it read the whole file against its record.
It keeps that in memory (:class:`ckptd.storage.local_store.LocalStore`); this module owns
the same knowledge on disk, for the next daemon: ``<part>.ckptd-verified`` holds the
file's identity (device, inode, size, mtime in ns) and the checksum record it matched.
A restarted daemon trusts a note only while the part still has that identity and its
record still says that checksum; anything else (no note, an unreadable one, a file
rewritten or replaced, a record changed) means a full read as before.

What a note cannot see is a byte that rots on the disk without the file changing: that
is caught where every byte is read anyway, by the trainer's load, which checks the part
against its record in the same pass, and by a peer receiving it as a replica.

A note is written atomically (a temporary file renamed into place) but not fsynced: it
is written on the daemon's serve loop, where an fsync of the file and its directory per
part would stall every client behind a slow or hung local disk. A crash may then lose a
note, or leave it empty or cut short; such a note never parses into the part's identity
and record, so it only costs the full read. No sockets, no threads of its own.
"""

from __future__ import annotations

import json
import logging
import os

from ckptd.checksum import VERIFIED_SUFFIX, ChecksumMismatchError, read_sidecar
from ckptd.storage.durable import remove_quietly, write_small_file

log = logging.getLogger(__name__)

__all__ = ["note_path", "identity_of", "write_note", "note_vouches_for", "drop_note"]


def note_path(path: str) -> str:
    """Where the note on ``path`` is kept."""
    return path + VERIFIED_SUFFIX


def identity_of(info: os.stat_result) -> list[int]:
    """A file's identity as notes record it: ``[device, inode, size, mtime_ns]``."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns]


def write_note(path: str) -> None:
    """Note that ``path``, as it is now, matched its checksum record.

    Not fsynced (see the module docstring). Failing to write the note is logged and
    otherwise ignored: the next daemon reads the part in full instead.
    """
    try:
        record = read_sidecar(path)
        note = {"identity": identity_of(os.stat(path)), "record": json.loads(record.to_json()),
                "daemon_pid": os.getpid()}
        write_small_file(note_path(path), json.dumps(note).encode(), fsync=False)
    except (OSError, ChecksumMismatchError, ValueError) as exc:
        log.info("could not note %s as verified (%s); the next daemon reads it in full", path,
                 exc)


def note_vouches_for(path: str, info: os.stat_result) -> bool:
    """Whether a note says ``path`` was verified with the identity ``info`` gives and
    the checksum record it still has."""
    try:
        with open(note_path(path), "rb") as f:
            note = json.loads(f.read())
        record = read_sidecar(path)
        return (isinstance(note, dict) and note.get("identity") == identity_of(info)
                and note.get("record") == json.loads(record.to_json()))
    except (OSError, ValueError, ChecksumMismatchError):
        return False


def drop_note(path: str) -> None:
    """Remove the note on ``path`` (the part failed, or was set aside)."""
    remove_quietly(note_path(path))
