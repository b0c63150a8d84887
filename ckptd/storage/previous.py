"""The file a save replaces: kept aside until the save is done, put back if it is not.

A save to a path that already holds a committed file (``last.ckpt`` every time, a DCP
directory saved again) renames its new file over the old one as soon as the new one is
durable, which is before the daemon knows whether the whole save succeeds: another file of
the same save may still fail, or the trainer may abort it or die. Removing the new file
then would leave nothing where the old checkpoint was. So before it writes, the writer
hard-links the old file (and its checksum record) to a hidden *previous* name the daemon
chose, and the daemon later either drops that link (the save is done) or renames it back
over the path (the save failed or was aborted), but only while the path still holds this
save's file: a later save's file is never replaced.

A writer given up as stuck is the one case where putting back must wait: the daemon
cannot stop a rename it had already begun (a hung target holds it, and lands it when it
answers), so the file goes back only once that writer process has exited
(:mod:`ckptd.server.save_writes`). Tiered saves keep the files they replace at their
target the same way (:mod:`ckptd.tiers.settle`).

Both renames are atomic: a reader sees the old file or the new one, whole, never a gap
and never a torn file. The previous names are temporaries of the daemon
(``.<name>.<daemon pid>.<token>.prev.ckptd-tmp``): nobody holds their lock, so after a
daemon crash its successor's sweep removes them (the path then holds a whole file, old or
new). On a filesystem without hard links nothing is kept and a failed overwrite behaves as
before: it removes the file it wrote.

Pattern: link aside, rename over, then drop or rename back. No sockets, no torch.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import secrets

from ckptd.checksum import TMP_MARKER, sidecar_path
from ckptd.storage.directories import fsync_directory, open_directory
from ckptd.storage.late_close import unlink_freeing_later

log = logging.getLogger(__name__)

#: errnos of a filesystem that has no hard links: nothing can be kept aside there.
_NO_LINKS = (errno_mod.EPERM, errno_mod.ENOTSUP, errno_mod.EOPNOTSUPP, errno_mod.EMLINK,
             errno_mod.EXDEV)


def previous_name(path: str, pid: int | None = None) -> str:
    """A fresh hidden name in ``path``'s directory to keep ``path``'s current file under."""
    head, tail = os.path.split(path)
    owner = os.getpid() if pid is None else pid
    return os.path.join(head, f".{tail}.{owner}.{secrets.token_hex(6)}.prev{TMP_MARKER}")


def _sidecar_previous(previous: str) -> str:
    head, tail = os.path.split(previous)
    return os.path.join(head, tail.replace(".prev" + TMP_MARKER, ".sum.prev" + TMP_MARKER))


def kept_record_name(previous: str) -> str:
    """Where :func:`keep_aside` keeps the checksum record of the file it keeps at
    ``previous``."""
    return _sidecar_previous(previous)


def keep_aside(path: str, previous: str) -> bool:
    """Link the file at ``path`` (and its checksum record) to ``previous``, before a new
    file is written and renamed over it (runs in the writer, before it writes).

    The directory is opened as :class:`ckptd.storage.durable.DurableFile` opens it,
    following no link.

    Returns
    -------
    bool
        True if something was kept, False if there is no file to keep (a new path) or
        the filesystem has no hard links.

    Raises
    ------
    OSError
        If the link fails otherwise (``EEXIST``: someone planted the name).
    """
    try:
        dir_fd, _ = open_directory(os.path.dirname(os.path.abspath(path)), create=False)
    except (FileNotFoundError, NotADirectoryError):
        return False  # a new directory (or none can exist there): nothing to keep
    name, kept = os.path.basename(path), os.path.basename(previous)
    try:
        for source, target in ((name, kept), (os.path.basename(sidecar_path(name)),
                                              _sidecar_previous(kept))):
            try:
                os.link(source, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd,
                        follow_symlinks=False)
            except FileNotFoundError:
                if source == name:
                    return False  # nothing there yet: nothing to keep
            except OSError as exc:
                if exc.errno not in _NO_LINKS:
                    raise
                log.warning("cannot keep %s aside while it is replaced (%s): a failed save "
                            "over it will leave nothing there", path, os.strerror(exc.errno))
                drop_previous(previous)
                return False
    finally:
        os.close(dir_fd)
    return True


def restore_previous(path: str, previous: str, file_id: list | None) -> bool:
    """Put back the file a failed or aborted save replaced at ``path``; never raises.

    It runs on the serve loop while a failed save is being wound up: an error here must
    not stop the failure from reaching the trainers, so it is logged instead (the kept
    link stays where it is, and the next start's sweep of temporaries removes it).

    Parameters
    ----------
    path : str
        The path the save wrote.
    previous : str
        Where the writer kept the replaced file (:func:`keep_aside`).
    file_id : list or None
        ``[st_dev, st_ino]`` of the file the save committed, or None when its writer
        never answered (then the path holds the old file or this save's new one: no
        other save of the path runs while a job writes it).

    Returns
    -------
    bool
        True if the previous file is back at ``path`` (and its checksum record beside it);
        the save's own file and record are gone then.
    """
    return restore_previous_of(path, previous, None if file_id is None else [file_id])


def restore_previous_of(path: str, previous: str, file_ids: list | None) -> bool:
    """:func:`restore_previous` where the save may have committed any of several files
    (a tiered flush tried again on a fresh temporary): ``file_ids`` lists each one's
    ``[st_dev, st_ino]``, or is None when unknown. Never raises."""
    try:
        return _restore(path, previous, file_ids)
    except OSError as exc:
        log.error("could not put back the previous %s from %s (%s): the save failed and "
                  "left the path as it was; check the directory's permissions and space",
                  path, previous, exc)
        return False


def _restore(path: str, previous: str, file_ids: list | None) -> bool:
    try:
        kept = os.lstat(previous)
    except (FileNotFoundError, NotADirectoryError):
        return False  # nothing was kept: the path was new, or the link never happened
    try:
        current = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        current = None
    if current is not None and current.st_ino == kept.st_ino and current.st_dev == kept.st_dev:
        # The file's rename never happened: the old file is still there. Its checksum
        # record is renamed before it, though, so the record may be the failed save's.
        _put_back_record(path, previous)
        drop_previous(previous)
        return False
    if file_ids is not None and (current is None or [current.st_dev, current.st_ino]
                                 not in [list(i) for i in file_ids]):
        drop_previous(previous)  # a later save's file is there now: it stays
        return False
    record = _sidecar_previous(previous)
    if os.path.lexists(record):
        os.replace(record, sidecar_path(path))
    else:  # the old file had no record: the one there now describes the new file
        try:
            os.unlink(sidecar_path(path))
        except FileNotFoundError:
            pass
    os.replace(previous, path)
    # A rename between two links of one file does nothing and leaves both: a target that
    # numbers its inodes by name (a FUSE layer without use_ino) hid that they were one.
    drop_previous(previous)
    fsync_directory(os.path.dirname(path) or ".")
    log.info("put back the previous %s: the save that replaced it did not complete", path)
    return True


def _put_back_record(path: str, previous: str) -> None:
    """``path`` still holds the kept file: make the record beside it the kept one."""
    record, kept_record = sidecar_path(path), _sidecar_previous(previous)
    try:
        kept = os.lstat(kept_record)
    except (FileNotFoundError, NotADirectoryError):
        kept = None
    try:
        current = os.lstat(record)
    except (FileNotFoundError, NotADirectoryError):
        current = None
    if current is None or (kept is not None and (current.st_dev, current.st_ino)
                           == (kept.st_dev, kept.st_ino)):
        return  # the record is the old file's own (or it had none and still has none)
    if kept is not None:
        os.replace(kept_record, record)
    else:  # the old file had no record: the one there describes the failed save's file
        os.unlink(record)
    fsync_directory(os.path.dirname(path) or ".")
    log.warning("put back the checksum record of %s: the save that failed had replaced it "
                "before its file", path)


def drop_previous(previous: str) -> None:
    """The save is done: the replaced file (and record) kept at ``previous`` go; the
    names at once, the data in the background (freeing it takes tens of milliseconds a
    GiB, and the daemon calls this from its serve loop)."""
    for name in (previous, _sidecar_previous(previous)):
        unlink_freeing_later(name)

