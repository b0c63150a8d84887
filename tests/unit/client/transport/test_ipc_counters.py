"""CUDA IPC reference counters are paid exactly once per export, whatever happens.

The trainer's :class:`ckpt_client.transport.cuda_exports.ExportCache` and the daemon's
:class:`ckptd.staging.exports.OpenExports` / :class:`SaveMappings` run for real; torch's
side of the bargain (``reduce_tensor`` sets a new counter to 1; ``rebuild_cuda_tensor``
opens a storage whose deleter pays, or pays at once when the storage is already open)
is played by :class:`TorchCounters`, written from torch 2.13's ``reductions.py`` and
``CudaIPCTypes.cpp``, since this machine has no GPU (``tests/gpu`` reads the real
counters). A counter below 0 is a release paid twice (the trainer's block leaves limbo
while the daemon may still map it); one left at 1 with nothing open is a block stuck in
limbo for good.
"""

from __future__ import annotations

import random
import weakref

import pytest

from ckpt_client.transport.cuda_exports import ExportCache, IpcPlan
from ckptd.staging.exports import OpenExports, export_id, stage_part, storage_key


class Storage:
    """An opened storage; freeing it pays its export's release (its deleter)."""


class TorchCounters:
    def __init__(self) -> None:
        self.counters: dict = {}
        self.opened_for: dict = {}            # export id -> weakref to the storage made for it
        self._open_storages = weakref.WeakValueDictionary()  # storage key -> live storage
        self._next = 0

    def export(self, key: tuple) -> dict:     # reduce_tensor in the trainer
        self._next += 1
        self.counters[("/torch_1_2", self._next)] = 1
        return {"device_uuid": f"GPU-{key[0]}", "handle": key, "storage_size": 64,
                "storage_offset": 0, "ref_counter_handle": "/torch_1_2",
                "ref_counter_offset": self._next, "event_handle": b"", "event_sync_required": False}

    def open(self, spec: dict) -> Storage:    # rebuild_cuda_tensor in the daemon
        live = self._open_storages.get(storage_key(spec))
        if live is not None:
            self.release(spec)
            return live
        storage = Storage()
        weakref.finalize(storage, self.release, spec)  # its deleter pays
        self._open_storages[storage_key(spec)] = storage
        self.opened_for[export_id(spec)] = weakref.ref(storage)
        return storage

    def release(self, spec: dict) -> None:    # _release_ipc_counter_cuda
        self.counters[export_id(spec)] -= 1

    def release_all(self, specs: list) -> None:  # protocol.release_ipc_counters
        for export in {export_id(spec): spec for spec in specs}.values():
            self.release(export)

    def check(self, quiet: bool) -> None:
        # storages hold no cycles: CPython frees them (and runs the deleters) at once
        assert min(self.counters.values()) >= 0, "a release was paid twice"
        if quiet:  # nothing in flight: every unpaid export has its storage open
            for export, value in self.counters.items():
                alive = export in self.opened_for and self.opened_for[export]() is not None
                assert value == int(alive), (export, value, alive)


class Daemon:
    """One trainer's exports on one device worker: ``stage_part`` as ``_DeviceWorker``
    calls it, with a copy that opens each buffer's export (and may fail part-way)."""

    def __init__(self, torch: TorchCounters) -> None:
        self.torch, self.exports = torch, OpenExports()

    def stage(self, specs: list, fail_after: int | None = None) -> list | None:
        indices = [i for i, s in enumerate(specs) if s is not None]

        def copy(mappings) -> None:
            for n, i in enumerate(indices):
                if n == fail_after:
                    raise RuntimeError("copy failed")
                mappings.storage(specs[i])

        try:
            held = stage_part(self.exports, [specs[i] for i in indices], self.torch.open, copy,
                              self.torch.release_all)
        except RuntimeError:
            return None
        return [i for i in indices if export_id(specs[i]) in held]

    def refuse(self, specs: list) -> None:   # CudaStager.release -> _Release
        self.torch.release_all(self.exports.unpaid([s for s in specs if s is not None], set()))


class Trainer:
    """One trainer process (its export cache) and its daemon, over torch's counters."""

    def __init__(self) -> None:
        self.torch = TorchCounters()
        self.cache = ExportCache(self.torch.release_all)
        self.daemon = Daemon(self.torch)

    def plan(self, keys: list) -> IpcPlan:
        halves, number, fresh = self.cache.storage_specs(keys,
                                                         lambda j: self.torch.export(keys[j]))
        return IpcPlan(halves, keys, self.cache, number, fresh)

    def save(self, keys: list, times: int = 1) -> IpcPlan:
        """``times`` saves of ``keys``, each staged and answered before the next."""
        for _ in range(times):
            save = self.plan(keys)
            save.settle(self.daemon.stage(save.specs))
        return save


PARAMS = [(0, p) for p in range(4)]


def test_a_steady_state_exports_each_storage_twice_then_reuses_it():
    job = Trainer()
    torch, cache, daemon = job.torch, job.cache, job.daemon
    for _ in range(20):
        save = job.plan(PARAMS + [PARAMS[0]])  # one storage twice (a view)
        save.settle(daemon.stage(save.specs))
        torch.check(quiet=True)
    assert len(torch.counters) == 2 * len(PARAMS), "first save, then the export kept open"
    assert cache.held_exports == {e for e, v in torch.counters.items() if v == 1}


def test_a_temporary_is_not_pinned_past_the_next_save():
    job = Trainer()
    torch, daemon = job.torch, job.daemon
    for step in range(6):
        temporary = [(0, 100 + step)]  # a new storage every save
        save = job.plan(PARAMS + temporary)
        save.settle(daemon.stage(save.specs))
        torch.check(quiet=True)
        (temporary_export,) = [export_id(s) for s in save.specs if s["handle"] == temporary[0]]
        assert torch.counters[temporary_export] == 0, "the temporary's block stays in limbo"


@pytest.mark.parametrize("seed", range(40))
def test_random_saves_failures_refusals_and_overlaps_pay_each_release_once(seed):
    rng = random.Random(seed)
    job = Trainer()
    torch, daemon = job.torch, job.daemon
    universe = [(d, s) for d in (0, 1) for s in range(5)]
    for _ in range(30):
        pending = []
        for _ in range(rng.choice((1, 1, 2))):  # 2: a zero-stall save planned before the
            keys = rng.sample(universe, rng.randint(1, 6))  # previous one was answered
            keys += rng.sample(keys, min(len(keys), rng.randint(0, 2)))  # views of these
            pending.append(job.plan(keys))
        answers = []
        for save in pending:  # the daemon takes them in the order they were planned...
            fate = rng.random()
            if fate < 0.05:  # aborted while queued: never reached the daemon
                save.withdraw()
                continue
            if fate < 0.1:
                daemon.refuse(save.specs)
                answers.append((save, None))
            elif fate < 0.25:
                daemon.stage(save.specs, fail_after=rng.randint(0, len(save.specs)))
                answers.append((save, None))
            else:
                answers.append((save, daemon.stage(save.specs)))
        if rng.random() < 0.3:  # ...but two threads may hear their answers out of order
            answers.reverse()
        for save, kept in answers:
            save.settle(kept)
        torch.check(quiet=True)
    daemon.exports = None  # the trainer leaves: the daemon forgets its mappings
    torch.check(quiet=True)
    assert set(torch.counters.values()) <= {0}, "every release paid once the daemon forgot"


def test_an_export_planned_while_another_save_was_in_flight_stays_owed_to_a_dead_daemon():
    job = Trainer()
    torch, cache, daemon = job.torch, job.cache, job.daemon
    job.save(PARAMS, times=3)  # the parameters' exports are held
    first = job.plan(PARAMS)   # re-sends the held exports...
    second = job.plan(PARAMS)  # ...planned before the first was answered: fresh
    for save in (first, second):
        save.settle(daemon.stage(save.specs))
    held_storages = daemon.exports       # the daemon is SIGKILLed: its deleters never run
    daemon.exports = None
    cache.pay_for_dead_daemon()
    assert max(torch.counters.values()) <= 0, "a parameter's block would stay in limbo"
    del held_storages


def test_a_dead_daemons_releases_are_paid_by_the_trainer():
    job = Trainer()
    torch, cache, daemon = job.torch, job.cache, job.daemon
    job.save(PARAMS, times=3)
    failed = job.plan([(0, 50), (0, 51)])
    daemon.stage(failed.specs, fail_after=1)  # one opened; then the daemon is SIGKILLed:
    held_storages = daemon.exports            # its deleters never run
    daemon.exports = None
    failed.settle(None)
    assert sum(torch.counters.values()) == len(PARAMS), "the held exports are unpaid"
    late = job.plan([(0, 60)])  # in flight when the daemon died
    assert cache.pay_for_dead_daemon() >= len(PARAMS)
    late.settle(None)
    assert max(torch.counters.values()) <= 0, "a block would stay in limbo for good"
    assert cache.held_exports == set()
    del held_storages


def test_an_export_that_fails_half_way_through_a_plan_is_paid_and_reuse_goes_on():
    job = Trainer()
    torch, cache, daemon = job.torch, job.cache, job.daemon
    job.save(PARAMS, times=2)

    def export_failing_on_the_new_storage(j):
        if keys[j] == (0, 70):
            raise RuntimeError("cudaIpcGetMemHandle failed")
        return torch.export(keys[j])

    keys = [(0, 71), (0, 70)]
    with pytest.raises(RuntimeError):
        cache.storage_specs(keys, export_failing_on_the_new_storage)
    assert torch.counters[("/torch_1_2", len(torch.counters))] == 0, "the export made first"
    again = job.plan(PARAMS)
    assert {export_id(s) for s in again.specs} == cache.held_exports, \
        "nothing is in flight any more: the held exports are re-sent"
    again.settle(daemon.stage(again.specs))
