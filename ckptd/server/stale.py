"""Stale saves: a rank's save whose every file has the bytes of its previous save.

When a checkpoint goes to a new path (the step advanced) but every file a rank wrote has
the same size and checksum as the files of its previous save, the trainer most likely
snapshotted stale buffers (a cache never refreshed, the wrong tensors). The writers
checksum every file anyway, so comparing costs nothing. Owns, per rank and save format,
the last successful save's file signature; :class:`ckptd.server.requests.RequestTable`
asks it about every successful save and counts what it finds.

A local part embeds its iteration in its header, so its bytes always change; DCP and
torch files carry only the state dict (a step counter inside it changes them too: only a
save whose every byte repeats is reported).
"""

from __future__ import annotations

import logging

from ckptd.protocol import SaveFormat

log = logging.getLogger(__name__)


class StaleSaveDetector:
    """Remembers each rank's last successful save and compares the next one with it."""

    def __init__(self) -> None:
        self._last: dict[tuple, tuple[str, tuple]] = {}  # (rank, format) -> (path, signature)

    def check(self, request) -> str | None:
        """The previous save's path when ``request`` (just done) repeats its bytes, else None."""
        if request.format == SaveFormat.LOCAL or not request.written:
            return None
        signature = tuple(sorted((w.get("size"), w.get("crc32")) for w in request.written))
        key = (request.rank, request.format)
        previous = self._last.get(key)
        self._last[key] = (request.path, signature)
        if previous is None or previous[0] == request.path or previous[1] != signature:
            return None
        log.warning("request %d (rank %d): %s has the very bytes of the previous save %s "
                    "(%d file(s), same checksums): the trainer may be saving stale tensors",
                    request.id, request.rank, request.path, previous[0], len(signature))
        return previous[0]
