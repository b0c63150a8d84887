"""Which CUDA exports a device worker holds open, and paying each export's release once.

torch sets each export's reference counter to 1, the one release the receiver owes, and
pays it when the storage opened for it is freed. So each export is opened at most once
(:class:`OpenExports`): a save that sends an export the worker still holds reuses the open
storage instead of calling torch's rebuild again; an export that is never opened (the
save was refused, aborted while queued, or failed first) has its counter released unless
it is held. Which exports stay open: those two consecutive saves used (parameters,
optimizer state); the rest are dropped once copied.

Pure bookkeeping: opening a storage, copying and releasing are passed in, so this module
must not import torch (and runs in unit tests without a GPU).
"""

from __future__ import annotations

from ckptd.protocol.ipc import ipc_export_id, release_ipc_counters

__all__ = ["export_id", "storage_key", "OpenExports", "SaveMappings", "stage_part"]

export_id = ipc_export_id


def storage_key(spec: dict) -> tuple:
    """Which storage a description exports (the same for every export of it)."""
    return (spec["handle"], spec["storage_offset"])


class OpenExports:
    """The exports of one trainer that one device worker holds open.

    Holding an export open means its release is still owed and will be paid when the
    storage is dropped from here; so an export that is held is never opened again nor
    released separately.
    """

    def __init__(self) -> None:
        self._open: dict = {}         # export id -> the storage opened for it
        self._previous: set = set()   # storage keys the previous save used

    def get(self, export: tuple):
        """The storage held open for ``export``, or ``None``."""
        return self._open.get(export)

    def holds(self, export: tuple) -> bool:
        """Whether ``export``'s release is owed by a storage held here."""
        return export in self._open

    def settle(self, used: dict) -> set:
        """A save finished using ``used`` (export id -> (storage key, storage)).

        Keeps open what this save and the one before used (by storage), drops the rest
        (freeing a storage pays its export's release) and returns the kept export ids.
        """
        kept = {e: storage for e, (key, storage) in used.items() if key in self._previous}
        self._previous = {key for key, _ in used.values()}
        self._open = kept
        return set(kept)

    def unpaid(self, specs: list, opened: set) -> list:
        """Of ``specs``, one per export that was neither opened (``opened``: export ids)
        nor is held here: their releases are owed now."""
        owed, seen = [], set(opened)
        for spec in specs:
            export = export_id(spec)
            if export not in seen and not self.holds(export):
                seen.add(export)
                owed.append(spec)
        return owed


class SaveMappings:
    """The storages one save copies from: an export held open is reused, any other is
    opened once (``open_export(spec) -> storage``), however often the save names it."""

    def __init__(self, exports: OpenExports, open_export) -> None:
        self.exports, self.open_export = exports, open_export
        self.used: dict = {}  # export id -> (storage key, storage)

    def storage(self, spec: dict):
        """The storage of ``spec``'s export, opened now if nothing holds it."""
        export = export_id(spec)
        found = self.exports.get(export)
        if found is None and export in self.used:
            found = self.used[export][1]
        if found is None:
            found = self.open_export(spec)
        self.used[export] = (storage_key(spec), found)
        return found

    def reuse(self, export: tuple, spec: dict, storage) -> bool:
        """Record that the save uses ``storage``, found by the caller for ``spec``, if it
        is still the one held open for ``export``; ``False`` (nothing recorded) if not."""
        if self.exports.get(export) is not storage:
            return False
        self.used[export] = (storage_key(spec), storage)
        return True

    def settle(self) -> set:
        """The save succeeded: keep what it shares with the one before (see
        :meth:`OpenExports.settle`); returns the kept export ids."""
        return self.exports.settle(self.used)

    def unpaid(self, specs: list) -> list:
        """Of ``specs``, those whose release is owed now (neither opened nor held)."""
        return self.exports.unpaid(specs, set(self.used))


def stage_part(exports: OpenExports, specs: list, open_export, copy,
               release=release_ipc_counters) -> set:
    """The export bookkeeping around one part's copy.

    ``copy(mappings)`` copies every buffer, opening exports through ``mappings``, and
    returns (or raises) only once nothing reads them any more. Returns the export ids
    kept open. Whatever happens, the releases owed now are paid (``release(specs)``) and
    what was not kept is dropped, paying its releases, before this returns.
    """
    mappings = SaveMappings(exports, open_export)
    try:
        copy(mappings)
        return mappings.settle()
    finally:
        release(mappings.unpaid(specs))
        mappings.used.clear()
