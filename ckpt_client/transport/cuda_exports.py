"""The CUDA IPC exports of this process's tensors that its daemon holds open.

Every buffer :mod:`ckpt_client.transport.cuda_routing` routes to the daemon goes as an
IPC description: the handle bytes, offsets and ref counter from
``torch.multiprocessing.reductions.reduce_tensor``, sent as msgpack fields, never
pickled. An export is sent again while the daemon holds it open (:class:`ExportCache`),
keyed by the storage's allocation, not the tensor object (``state_dict()`` makes new ones
on every call): re-exporting grows torch's per-storage sent-data chain, and sending an
export the daemon already released would make it release the counter twice. Every save
records a fresh inter-process event on each device's current stream: the daemon's copy
stream waits on it, so the copy is ordered after the kernels that produced the values.

One cache per connection (:func:`export_cache`); it registers on the connection
(``when_daemon_dies``) to pay, once the daemon died, the releases the daemon owed.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from ckptd import protocol
from ckpt_client.transport.cuda_routing import (IPC, device_uuid, facts_of, ipc_blocked_reason,
                                                route)

log = logging.getLogger(__name__)
_warned: set[str] = set()


def _storage_of(tensor: torch.Tensor) -> tuple:
    """Which allocation a tensor's storage is (state_dict() makes new tensor objects on
    every call, so the storage, not the tensor, is what stays the same between saves)."""
    storage = tensor.untyped_storage()
    return (tensor.device.index, storage.data_ptr(), storage.nbytes())


class ExportCache:
    """The exports of this process's CUDA storages that its daemon holds open.

    Torch sets every export's reference counter to 1: the one release the daemon owes,
    paid when it drops what it opened. An export may therefore be sent again only while
    the daemon still holds it, which the STAGED reply of the save it was last sent in
    says (``ipc_kept``); anything else is exported afresh (a new counter). A held export
    keeps its storage's block out of reuse, so the allocation it names is still the one
    this process holds under the same address. While a save is in flight nothing is
    reused: its reply may still drop what an earlier reply kept.

    Releases nobody else will pay are paid here with ``release(specs)``: fresh exports of
    a save that never reached the daemon, and, once the daemon died, every release it
    may have owed (held exports, those of failed saves, and of saves still in flight);
    paying one twice harms nothing once nobody maps the block.
    """

    def __init__(self, release) -> None:
        self._release = release
        self._held: dict = {}   # storage key -> the description of its held export
        self._owed: dict = {}   # export id -> (storage key, description): maybe unpaid
        self._in_flight = 0
        self._sent = self._settled = 0  # sequence numbers of saves
        self._daemon_dead = False
        self._lock = threading.Lock()

    def storage_specs(self, keys: list, export) -> tuple[list, int, list]:
        """The storage half of each description of a save.

        ``keys[j]`` is a storage key (or ``None``: no description); it gets its held
        export, or ``export(j)``'s fresh one, shared by every entry of the same storage
        (views of one storage go out as one export). The save counts as in flight until
        :meth:`settle` or :meth:`withdraw`.

        Returns
        -------
        (halves, number, fresh)
            Per key its storage half; the save's number; the fresh exports made for it.
        """
        with self._lock:
            held = self._held if not self._in_flight else {}  # replaced, never changed
            self._in_flight += 1
            self._sent += 1
            number = self._sent
        chosen: dict = {}
        fresh: list = []
        try:
            for j, key in enumerate(keys):
                if key is not None and key not in chosen:
                    chosen[key] = held.get(key)
                    if chosen[key] is None:
                        chosen[key] = export(j)
                        fresh.append(chosen[key])
        except BaseException:
            self.withdraw(fresh)
            raise
        return [chosen[key] if key is not None else None for key in keys], number, fresh

    def withdraw(self, fresh: list) -> None:
        """A save that never reached the daemon: pay its fresh exports' releases."""
        self._release(fresh)
        with self._lock:
            self._in_flight -= 1

    def settle(self, number: int, keys: list, specs: list, kept: list | None) -> None:
        """Save ``number`` ended: staged, with the ``kept`` indices the daemon holds open,
        or failed (``None``: whatever it opened may or may not be paid yet)."""
        sent = {protocol.ipc_export_id(h): (k, h) for k, h in zip(keys, specs) if h is not None}
        held = {keys[i]: specs[i] for i in kept or () if specs[i] is not None}
        with self._lock:
            self._in_flight -= 1
            if self._daemon_dead:  # nobody else will pay these now
                owed, sent = list(sent.values()), {}
            else:
                owed = []
                self._record(number, sent, held, kept is not None)
        self._release([spec for _, spec in owed])

    def _record(self, number: int, sent: dict, held: dict, staged: bool) -> None:
        newest = number > self._settled
        self._settled = max(self._settled, number)
        self._held = held if newest and number == self._sent else {}
        if not staged or not newest:
            self._owed.update(sent)
            return
        # Staged: on the devices of this save the daemon now holds the kept storages and
        # paid for everything else of ours there. A kept storage may be owed under an
        # earlier export (torch paid the new one at once when it found it open), so every
        # export of a kept storage stays owed.
        devices = {key[0] for key, _ in sent.values()}
        self._owed = {e: v for e, v in self._owed.items()
                      if v[0][0] not in devices or v[0] in held}
        self._owed.update({protocol.ipc_export_id(h): (k, h) for k, h in held.items()})

    @property
    def held_exports(self) -> set:
        """Export ids the daemon holds open (for tests and diagnostics)."""
        with self._lock:
            return {protocol.ipc_export_id(spec) for spec in self._held.values()}

    def pay_for_dead_daemon(self) -> int:
        """The daemon died: pay each release it may have owed, now and for saves still in
        flight when they end. Returns how many were paid now."""
        with self._lock:
            owed, self._owed, self._held = list(self._owed.values()), {}, {}
            self._daemon_dead = True
        self._release([spec for _, spec in owed])
        return len(owed)


def _export(tensor: torch.Tensor) -> dict:
    """A fresh export of ``tensor``'s storage (torch's reductions; a new counter slot)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(tensor.detach())  # autograd state is not ours to share
    (_, _, _, _, _, _, device, handle, storage_size, storage_offset,
     _, ref_handle, ref_offset, event_handle, event_sync) = args
    return {"device_uuid": device_uuid(device), "handle": handle, "storage_size": storage_size,
            "storage_offset": storage_offset, "ref_counter_handle": ref_handle,
            "ref_counter_offset": ref_offset, "event_handle": event_handle,
            "event_sync_required": event_sync}


def _describe(tensor: torch.Tensor, storage: dict) -> dict:
    """The tensor half (its view of the storage) joined to the storage half."""
    return {**storage, "size": list(tensor.shape), "stride": list(tensor.stride()),
            "offset": tensor.storage_offset(), "dtype": str(tensor.dtype).removeprefix("torch.")}


_caches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_caches_lock = threading.Lock()


def export_cache(connection) -> ExportCache:
    """The export cache of a connection (one daemon holds one set of our exports).

    Made on first use, and registered with the connection: when it closes with its
    daemon dead, :func:`daemon_died` pays what that daemon owed.
    """
    with _caches_lock:
        if connection not in _caches:
            _caches[connection] = ExportCache(protocol.release_ipc_counters)
            connection.when_daemon_dies(daemon_died)
        return _caches[connection]


def daemon_died(connection) -> None:
    """Pay the IPC releases a dead daemon owed us (its connection closed)."""
    with _caches_lock:
        cache = _caches.pop(connection, None)
    if cache is not None:
        paid = cache.pay_for_dead_daemon()
        if paid:
            log.info("paid %d CUDA IPC reference(s) the dead daemon (pid %d) held",
                     paid, connection.daemon_pid)


@dataclass
class IpcPlan:
    """The IPC descriptions of one save, and the cache that must hear how it ended."""

    specs: list          # per source: its description, or None (copied through shm)
    keys: list           # per source: its storage key, or None
    cache: ExportCache
    number: int          # the cache's number for this save
    fresh: list          # the exports made for this save (not re-sent held ones)
    settled: bool = False

    def settle(self, kept: list | None) -> None:
        """The save reached the daemon and was staged (``kept``: its ``ipc_kept``) or
        failed (``None``); only the first call of this or :meth:`withdraw` counts."""
        if not self.settled:
            self.settled = True
            self.cache.settle(self.number, self.keys, self.specs, kept)

    def withdraw(self) -> None:
        """The save never reached the daemon (aborted while queued): nobody opened its
        fresh exports, so their releases are paid here."""
        if not self.settled:
            self.settled = True
            self.cache.withdraw(self.fresh)


def plan_ipc(connection, sources: list) -> tuple[IpcPlan | None, list]:
    """One entry per source: the IPC description the daemon copies from, or ``None``.

    Returns
    -------
    (plan, events)
        ``plan`` is ``None`` when no source goes by IPC (a shm-only request); else it
        must be settled once the save is staged or failed. ``events`` are the producer
        events recorded here (one per device and save), which order the daemon's copy
        after the work queued so far on each device's current stream; keep them alive
        until the save is staged.
    """
    if not connection.has_cuda or not any(isinstance(s, torch.Tensor) and s.is_cuda
                                          for s in sources):
        return None, []
    blocked = connection.ipc_denied or ipc_blocked_reason(connection.daemon_pid)
    routes, notes = route([facts_of(s) for s in sources], set(connection.cuda_devices), blocked)
    for note in notes:
        if note not in _warned:
            _warned.add(note)
            warnings.warn(f"ckptd: {note}", RuntimeWarning, stacklevel=3)
    if IPC not in routes:
        return None, []
    cache = export_cache(connection)
    keys = [_storage_of(source) if how == IPC else None for source, how in zip(sources, routes)]
    storages, number, fresh = cache.storage_specs(keys, lambda j: _export(sources[j]))
    ready: dict[int, bytes] = {}
    specs, events = [], []
    try:
        for source, storage in zip(sources, storages):
            if storage is None:
                specs.append(None)
                continue
            index = source.device.index
            if index not in ready:
                event = torch.cuda.Event(interprocess=True)
                event.record(torch.cuda.current_stream(index))
                ready[index] = event.ipc_handle()
                events.append(event)
            specs.append({**_describe(source, storage), "ready_event": ready[index]})
    except BaseException:
        cache.withdraw(fresh)  # never sent
        raise
    return IpcPlan(specs, keys, cache, number, fresh), events
