"""Directories the daemon writes into: opened without following a link, created durably.

Owns the walk from ``/`` to a checkpoint directory one component at a time with
``O_NOFOLLOW`` (a link planted after the path was checked is refused, not followed), the
creation of missing directories (each new one fsynced into its parent, so a committed
checkpoint cannot vanish with its directory after a power loss), and the directory fsync
that makes a rename, creation or unlink inside it durable. Files inside them are
:mod:`ckptd.storage.durable`'s. No torch, no sockets.
"""

from __future__ import annotations

import errno as errno_mod
import os
import stat


def fsync_directory(path: str) -> None:
    """Make a rename, a creation or an unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: How a directory is opened: for reading its entries, never inherited by a child.
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def open_directory(path: str, create: bool = True) -> tuple[int, list[str]]:
    """Open a directory walking from ``/`` one component at a time, never following a link.

    Checkpoint paths reach here already resolved (``ckptd.storage.roots`` checked their
    real location); a component that is a symbolic link *now* was planted after that
    check, so the walk refuses it instead of writing where it points.

    Parameters
    ----------
    path : str
        An absolute path.
    create : bool
        Create missing components; each new directory is made durable in its parent.

    Returns
    -------
    (fd, created)
        An open descriptor of the directory (the caller closes it) and the directories
        created, outermost first.

    Raises
    ------
    OSError
        ``ELOOP`` naming the component that is a link, ``ENOTDIR`` for one that is a
        file, ``ENOENT`` for a missing one when ``create`` is false.
    """
    if not os.path.isabs(path):
        raise ValueError(f"{path!r} is not an absolute path")
    fd = os.open("/", DIRECTORY_FLAGS)
    created, walked = [], ""
    try:
        for part in [p for p in path.split("/") if p not in ("", ".")]:
            if part == "..":
                raise OSError(errno_mod.EINVAL, "'..' in a checkpoint path", path)
            walked += "/" + part
            try:
                child = os.open(part, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(part, 0o777, dir_fd=fd)
                    os.fsync(fd)  # the new entry survives a power loss
                    created.append(walked)
                except FileExistsError:
                    pass  # made by someone else meanwhile; they make it durable
                child = os.open(part, DIRECTORY_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                if _is_link(part, fd):  # O_NOFOLLOW | O_DIRECTORY says ENOTDIR or ELOOP
                    raise OSError(errno_mod.ELOOP, "is a symbolic link; ckptd does not follow "
                                  "links inside a checkpoint path (planted after the path was "
                                  "checked?)", walked) from None
                raise OSError(exc.errno, exc.strerror, walked) from None
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd, created


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def make_directories(path: str) -> list[str]:
    """Create ``path`` and its missing parents durably, following no link.

    Returns
    -------
    list of str
        The directories created (outermost first).
    """
    fd, created = open_directory(os.path.abspath(path), create=True)
    os.close(fd)
    return created
