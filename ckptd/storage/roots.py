"""Which paths the daemon may write: the allowed checkpoint roots.

A trainer names a destination; the daemon writes there with its own credentials, so a
path is accepted only if it is absolute, has no ``..`` component, and its real location
(symlinks resolved, for the part that exists) lies inside one of the ``--root``
directories. This module only decides; it never creates or writes anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


class PathRefusedError(ValueError):
    """A destination outside the allowed roots, or otherwise unsafe."""


@dataclass(frozen=True)
class AllowedRoots:
    """The set of directories checkpoints may be written under.

    Parameters
    ----------
    roots : tuple of str
        Directories; stored with symlinks resolved.
    """

    roots: tuple

    @classmethod
    def of(cls, roots) -> "AllowedRoots":
        """Build from user-given directories (resolved once, at start-up)."""
        return cls(tuple(os.path.realpath(os.path.abspath(r)) for r in roots))

    def root_of(self, resolved: str) -> str | None:
        """The allowed root a resolved path lies in (the innermost), or None."""
        inside = [r for r in self.roots
                  if resolved == r or resolved.startswith(r.rstrip(os.sep) + os.sep)]
        return max(inside, key=len) if inside else None

    def check(self, path: str) -> str:
        """Return the resolved destination for ``path`` or refuse it.

        Raises
        ------
        PathRefusedError
            If ``path`` is relative, contains ``..``, or resolves outside every root.
        """
        if not isinstance(path, str) or not path:
            raise PathRefusedError("checkpoint path is empty")
        if "\x00" in path:
            raise PathRefusedError(f"checkpoint path {path!r} contains a NUL byte")
        if not os.path.isabs(path):
            raise PathRefusedError(f"checkpoint path {path!r} is not absolute")
        if ".." in path.split(os.sep):
            raise PathRefusedError(
                f"checkpoint path {path!r} contains '..'; give the directory without it")
        resolved = os.path.realpath(path)
        if self.root_of(resolved) is not None:
            return resolved
        where = "resolves to " + resolved + " which is" if resolved != path else "is"
        raise PathRefusedError(
            f"checkpoint path {path} {where} outside the allowed roots "
            f"({', '.join(self.roots)}); save under one of them or start ckptd with --root")
