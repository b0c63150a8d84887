"""The memory tier on the real lifecycle and pool: a done local part keeps its extent under
one more named hold, given back exactly once (newer commit, a save needing space, stop)."""

from __future__ import annotations

import random

from ckptd import knobs
from ckptd.protocol import Phase
from ckptd.server.lifecycle import CLIENT_COPY, RESIDENT, WRITERS, SaveLifecycle
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.server.resident import ResidentParts

from test_lifecycle import UNIT, Effects, pool  # noqa: F401 (fixture)


def local(table: RequestTable, iteration: int, nbytes: int = UNIT, rank: int = 0) -> SaveRequest:
    return SaveRequest(id=table.new_id(), rank=rank, routing_id=b"c", format="local",
                       path=f"/l/iter_{iteration}/rank_{rank}.part",
                       buffers=[["bytes", [64], 64], ["uint8", [nbytes - 128], nbytes - 128]],
                       offsets=[0, 64], extent_length=nbytes, session="s", iteration=iteration)


def setup(pool, **effects):
    table, fx = RequestTable(), Effects(**effects)
    life = SaveLifecycle(pool, table, fx)
    resident = ResidentParts(pool)
    life.on_done, life.reclaim = resident.keep, resident.reclaim
    return table, life, resident


def save(life, request, ok=True) -> None:
    assert life.admit(request)
    life.copied(request, CLIENT_COPY)
    life.job_done(request, request.path, ok, {"path": request.path, "crc32": 7, "size": 99,
                                              "algorithm": "crc32c"}, 99,
                  None if ok else "EIO", None if ok else 5)


def test_a_done_local_part_stays_in_the_pool_until_a_newer_one_is_committed(pool):
    table, life, resident = setup(pool)
    first = local(table, 1)
    save(life, first)
    assert first.phase == Phase.DONE and first.lease.holds == {RESIDENT}
    assert pool.returned == [] and resident.describe() == {"parts": 1, "bytes": UNIT}
    base = first.extent.offset
    assert resident.lookup("s", 0, 1) == {"items": [[base, 64], [base + 64, UNIT - 128]],
                                          "crc": 7, "size": 99, "algorithm": "crc32c"}
    second = local(table, 2)
    save(life, second)
    resident.committed("s", 1)
    assert pool.returned == [], "committing the same iteration keeps it"
    resident.committed("s", 2)
    assert pool.returned == [first.lease.extent] and resident.lookup("s", 0, 1) is None
    resident.release_all()
    resident.release_all()
    assert sorted(pool.returned, key=lambda e: e.offset) == sorted(
        [first.lease.extent, second.lease.extent], key=lambda e: e.offset)
    assert pool.free_bytes == pool.size


def test_a_save_that_does_not_fit_takes_the_space_of_resident_parts(pool):
    table, life, resident = setup(pool)
    for iteration in (1, 2):
        save(life, local(table, iteration, 3 * UNIT))
    big = local(table, 3, 6 * UNIT)
    assert life.admit(big), "both resident parts gave their space back, oldest first"
    assert resident.describe()["parts"] == 0 and len(pool.returned) == 2


def test_failed_saves_never_stay_and_the_tier_can_be_switched_off(pool):
    table, life, resident = setup(pool)
    failed = local(table, 1)
    save(life, failed, ok=False)
    assert failed.phase == Phase.FAILED and failed.lease.released
    with knobs.override(MEMORY_TIER=False):
        off = local(table, 2)
        save(life, off)
    assert off.lease.released and resident.describe()["parts"] == 0
    dcp = SaveRequest(id=table.new_id(), rank=0, routing_id=b"c", format="dcp", path="/x",
                      buffers=[["uint8", [UNIT], UNIT]], offsets=[0], extent_length=UNIT)
    save(life, dcp)
    assert dcp.lease.released, "only local parts are kept"


def test_a_replicated_part_becomes_resident_after_its_last_replica(pool):
    table, life, resident = setup(pool, holders=("tcp://h:1",))
    request = local(table, 1)
    save(life, request)
    assert request.phase == Phase.REPLICATING and not request.lease.has(RESIDENT)
    life.replica_done(request, "tcp://h:1", True, None, 99)
    assert request.phase == Phase.DONE and request.lease.holds == {RESIDENT}


def test_random_orders_with_the_memory_tier_give_every_extent_back_exactly_once(pool):
    rng = random.Random(4242)
    for _ in range(150):
        pool.returned.clear()
        holders = [f"tcp://h{i}:1" for i in range(rng.randint(0, 2))]
        table, life, resident = setup(pool, jobs=1, holders=holders)
        requests = [local(table, i % 3, rng.choice([UNIT, 3 * UNIT]), rank=i % 2)
                    for i in range(5)]
        for r in requests:
            life.admit(r)
        for _ in range(300):
            live = [r for r in requests if r.lease and not r.lease.released
                    and (not r.finished or r.lease.holds - {RESIDENT})]
            if not live:
                break
            r, move = rng.choice(live), rng.random()
            if move < 0.05:
                life.abort(r, "random abort")
            elif move < 0.1:
                resident.committed("s", rng.randint(0, 3))
            elif r.phase == Phase.STAGING and r.lease.has(CLIENT_COPY):
                life.copied(r, CLIENT_COPY)
            elif r.lease.has(WRITERS) and r.jobs_pending:
                life.job_done(r, r.path, rng.random() > 0.1, {"path": r.path, "crc32": 1,
                                                               "size": 1}, 1, "EIO", 5)
            elif any(h.startswith("replica:") for h in r.lease.holds):
                holder = next(h for h in r.lease.holds if h.startswith("replica:"))[8:]
                life.replica_done(r, holder, rng.random() > 0.3, "down", 1)
        resident.release_all()
        for r in requests:
            if r.lease is not None and not r.lease.released:  # still waiting: abort it
                life.abort(r, "end of the test")
        assert all(r.finished for r in requests if r.lease is not None and r.lease.released)
        extents = [r.lease.extent for r in requests if r.lease is not None and r.lease.released]
        assert sorted(pool.returned, key=lambda e: e.offset) == sorted(extents,
                                                                       key=lambda e: e.offset)
