"""The save lifecycle without sockets: every path that ends a save gives its extent back once.

The staging pool is a real shared-memory pool; the lifecycle's effects (answering the
client, writer jobs, pushes, removing outputs) are recorded by a small stand-in for the
save service, since the point here is the state machine itself. The real effects run in
the integration tests.
"""

from __future__ import annotations

import os
import random

import pytest

from ckptd.protocol import EXTENT_ALIGNMENT, Phase
from ckptd.server.lifecycle import (CLIENT_COPY, DEVICE_COPY, WRITERS, ExtentLease,
                                    SaveLifecycle, replica_hold)
from ckptd.server.requests import ReplicaSet, RequestTable, SaveRequest
from ckptd.staging.pool import StagingPool

UNIT = EXTENT_ALIGNMENT


class CountingPool(StagingPool):
    """A real pool that counts how often each extent comes back."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.returned: list = []

    def release(self, extent):
        self.returned.append(extent)
        return super().release(extent)


class Call:
    """Records how a deferred request was answered."""

    def __init__(self) -> None:
        self.answers: list = []

    def reply(self, body):
        self.answers.append(("reply", body))

    def fail(self, code, message, hint="", **context):
        self.answers.append(("error", code))


class Effects:
    """Records what the lifecycle asked for; jobs and holders are set per test."""

    def __init__(self, jobs: int = 1, holders: tuple = ()) -> None:
        self.jobs, self.holders = jobs, list(holders)
        self.granted, self.removed, self.cancelled, self.staged_ids = [], [], [], []
        self.device_cancelled, self.writes_cancelled = [], []
        self.phases: list = []  # (request id, phase) of every phase change, in order

    def phase_changed(self, request):
        self.phases.append((request.id, request.phase))

    def space_granted(self, request):
        self.granted.append(request.id)

    def staged(self, request):
        self.staged_ids.append(request.id)

    def write(self, request):
        return self.jobs

    def replicate(self, request):
        if self.holders:
            request.replicas = ReplicaSet.sending_to(len(self.holders), self.holders)
        return list(self.holders)

    def cancel_replication(self, request):
        self.cancelled.append(request.id)

    def cancel_device_copy(self, request):
        self.device_cancelled.append((request.id, request.lease is not None))

    def remove_outputs(self, request):
        self.removed.append(request.id)

    def cancel_writes(self, request):
        self.writes_cancelled.append(request.id)


@pytest.fixture
def pool(tmp_path):
    p = CountingPool(f"/dev/shm/ckptd-test-lifecycle-{os.getpid()}-{tmp_path.name}", 8 * UNIT)
    yield p
    p.close()


def make(table: RequestTable, nbytes: int = UNIT) -> SaveRequest:
    return SaveRequest(id=table.new_id(), rank=0, routing_id=b"c", format="dcp", path="/ckpt/x",
                       buffers=[["uint8", [nbytes], nbytes]], offsets=[0], extent_length=nbytes)


def setup(pool, **effects):
    table, fx = RequestTable(), Effects(**effects)
    return table, fx, SaveLifecycle(pool, table, fx)


def ok(lifecycle, request, index=0):
    lifecycle.job_done(request, f"/ckpt/x/f{index}", True, {"path": f"/ckpt/x/f{index}"}, 10)


def test_a_save_writes_then_gives_its_extent_back_once(pool):
    table, fx, life = setup(pool, jobs=2)
    request = make(table)
    assert life.admit(request) and request.phase == Phase.STAGING
    life.copied(request, CLIENT_COPY)
    assert request.phase == Phase.WRITING and request.lease.holds == {WRITERS}
    ok(life, request, 0)
    assert request.phase == Phase.WRITING and pool.returned == []
    ok(life, request, 1)
    assert request.phase == Phase.DONE and request.bytes_written == 20
    assert pool.returned == [request.lease.extent] and pool.free_bytes == pool.size
    assert table.saves_done == 1 and fx.removed == []


def test_a_request_that_does_not_fit_waits_and_is_answered_when_space_frees(pool):
    table, fx, life = setup(pool)
    first, second = make(table, 6 * UNIT), make(table, 4 * UNIT)
    assert life.admit(first)
    assert not life.admit(second) and second.phase == Phase.WAITING_FOR_POOL
    life.copied(first, CLIENT_COPY)
    ok(life, first)
    assert fx.granted == [second.id] and second.phase == Phase.STAGING
    assert second.extent is not None


def test_aborting_a_waiting_request_answers_it_and_lets_the_next_one_in(pool):
    table, fx, life = setup(pool)
    first, waiting, behind = make(table, 5 * UNIT), make(table, 6 * UNIT), make(table, 2 * UNIT)
    life.admit(first)
    life.admit(waiting)
    life.admit(behind)  # FIFO: waits behind `waiting` although it would fit
    waiting.pending_reply = call = Call()
    life.abort(waiting, "the trainer went away")
    assert waiting.phase == Phase.ABORTED and call.answers == [("error", "aborted")]
    assert fx.granted == [behind.id] and behind.extent is not None
    assert pool.waiting == 0


def test_aborting_while_the_client_copies_frees_the_extent_at_once(pool):
    table, fx, life = setup(pool)
    request = make(table)
    life.admit(request)
    life.abort(request, "close(abort=True)")
    assert request.phase == Phase.ABORTED and pool.returned == [request.lease.extent]
    assert table.in_flight() == []


def test_aborting_while_writing_keeps_the_extent_until_the_writers_answer(pool):
    table, fx, life = setup(pool, jobs=1)
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    life.abort(request, "aborted")
    assert request.phase == Phase.ABORTED and pool.returned == [] and fx.removed == []
    ok(life, request)
    assert fx.removed == [request.id], "a file renamed after the abort must be removed"
    assert pool.returned == [request.lease.extent] and request.phase == Phase.ABORTED


def test_a_write_error_fails_the_save_and_removes_what_it_wrote(pool):
    table, fx, life = setup(pool, jobs=2)
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    ok(life, request)
    life.job_done(request, "/ckpt/x/f1", False, None, 10, "No space left on device", 28)
    assert request.phase == Phase.FAILED and fx.removed == [request.id]
    assert "errno 28" in request.error and request.error.startswith("rank 0: writing /ckpt/x/f1")
    assert table.saves_failed == 1 and pool.free_bytes == pool.size


@pytest.mark.parametrize("writers_first", [True, False])
def test_a_replicated_save_ends_after_its_writes_and_every_replica(pool, writers_first):
    table, fx, life = setup(pool, jobs=1, holders=("tcp://a:1", "tcp://b:1"))
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    assert request.lease.holds == {WRITERS, replica_hold("tcp://a:1"), replica_hold("tcp://b:1")}
    if writers_first:
        ok(life, request)
        assert request.phase == Phase.REPLICATING
    life.replica_done(request, "tcp://a:1", True, None, 10)
    life.replica_done(request, "tcp://b:1", False, "peer down", 0)
    if not writers_first:
        assert request.phase == Phase.WRITING and pool.returned == []
        ok(life, request)
    assert request.phase == Phase.DONE and request.replicas.reduced_redundancy
    assert request.replicas.failures == {"tcp://b:1": "peer down"}
    assert pool.returned == [request.lease.extent]


def test_aborting_while_replicating_cancels_pushes_and_waits_for_their_answers(pool):
    table, fx, life = setup(pool, jobs=1, holders=("tcp://a:1",))
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    ok(life, request)
    life.abort(request, "aborted")
    assert fx.cancelled == [request.id] and fx.removed == [request.id]
    assert pool.returned == [], "the push still reads the extent"
    life.replica_done(request, "tcp://a:1", False, "the save was aborted", 0)
    assert pool.returned == [request.lease.extent] and request.phase == Phase.ABORTED


def device_save(pool):
    """A save whose bytes the CUDA stager copies; its STAGE is answered when it is done."""
    table, fx, life = setup(pool)
    request = make(table)
    life.admit(request, (DEVICE_COPY,))
    request.pending_reply = call = Call()
    return life, request, call


def test_a_device_copy_keeps_the_extent_of_an_aborted_save_until_it_stops(pool):
    life, request, call = device_save(pool)
    life.abort(request, "trainer gone")
    assert call.answers == [("error", "aborted")] and pool.returned == []
    assert life.effects.device_cancelled == [(request.id, True)], "the copy must be cancelled"
    life.copied(request, DEVICE_COPY)
    assert pool.returned == [request.lease.extent] and request.phase == Phase.ABORTED


def test_a_failed_device_copy_fails_the_save_and_answers_the_trainer(pool):
    life, request, call = device_save(pool)
    life.copied(request, DEVICE_COPY, "CUDA error: an illegal memory access")
    assert request.phase == Phase.FAILED and call.answers == [("error", "internal")]
    assert "illegal memory access" in request.error and pool.free_bytes == pool.size


def test_a_device_copy_the_kernel_denied_answers_with_its_own_code(pool):
    life, request, call = device_save(pool)
    life.copied(request, DEVICE_COPY, "the kernel denied ckptd ...", "ipc_denied")
    assert request.phase == Phase.FAILED and call.answers == [("error", "ipc_denied")]
    assert request.error_code == "ipc_denied" and pool.free_bytes == pool.size
    assert request.failure_code == "ipc_denied", "a STAGED arriving after it gets the same code"


def test_an_ended_request_is_refused_with_the_code_of_how_it_ended(pool):
    life, failed, _ = device_save(pool)
    life.copied(failed, DEVICE_COPY, "CUDA error: an illegal memory access")
    life2, aborted, _ = device_save(pool)
    life2.abort(aborted, "trainer gone")
    assert (failed.failure_code, aborted.failure_code) == ("internal", "aborted")


def test_a_save_filled_by_two_copiers_writes_only_when_both_are_done(pool):
    table, fx, life = setup(pool)
    request = make(table)
    life.admit(request, (CLIENT_COPY, DEVICE_COPY))
    life.copied(request, DEVICE_COPY)
    assert request.phase == Phase.STAGING and fx.staged_ids == []
    life.copied(request, CLIENT_COPY)
    assert request.phase == Phase.WRITING and fx.staged_ids == [request.id]


def test_a_device_save_that_does_not_fit_waits_like_any_other(pool):
    table, fx, life = setup(pool)
    first = make(table, 6 * UNIT)
    life.admit(first)
    queued = make(table, 4 * UNIT)
    assert not life.admit(queued, (DEVICE_COPY,)) and queued.phase == Phase.WAITING_FOR_POOL
    life.copied(first, CLIENT_COPY)
    ok(life, first)
    assert fx.granted == [queued.id] and queued.lease.holds == {DEVICE_COPY}
    life.copied(queued, DEVICE_COPY)
    assert queued.phase == Phase.WRITING and fx.staged_ids == [first.id, queued.id]


def test_a_forgotten_request_is_still_found_until_its_extent_comes_back(pool):
    table, fx, life = setup(pool, jobs=1)
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    life.abort(request, "aborted")
    table.forget(request.id)
    assert table.get(request.id) is None and table.find(request.id) is request
    ok(life, request)
    assert table.find(request.id) is None and pool.free_bytes == pool.size


def test_a_lease_gives_its_extent_back_exactly_once():
    returned = []
    lease = ExtentLease("extent", returned.append, ["a", "b"])
    lease.drop("a")
    lease.drop("a")
    assert returned == []
    lease.drop("b")
    lease.drop("b")
    assert returned == ["extent"] and lease.released
    with pytest.raises(RuntimeError, match="already given back"):
        lease.hold("c")


def test_random_event_orders_end_every_save_once_and_free_the_whole_pool(pool):
    """Many saves, events in random orders (aborts and failures anywhere): afterwards each
    extent came back exactly once, the pool is empty, and each save has one outcome."""
    rng = random.Random(20261123)
    for _ in range(200):
        pool.returned.clear()
        holders = [f"tcp://h{i}:1" for i in range(rng.randint(0, 2))]
        table, fx, life = setup(pool, jobs=rng.randint(0, 2), holders=holders)
        requests = [make(table, rng.choice([UNIT, 3 * UNIT, 5 * UNIT])) for _ in range(4)]
        pending = {r.id: {"admit"} for r in requests}
        for r in requests:
            life.admit(r)
        for _ in range(400):
            live = [r for r in requests if pending[r.id] or (r.lease and not r.lease.released)]
            if not live:
                break
            r = rng.choice(live)
            move = rng.random()
            if move < 0.1:
                life.abort(r, "random abort")
            elif move < 0.15:
                life.fail(r, "random failure")
            elif r.phase == Phase.STAGING and r.lease.has(CLIENT_COPY):
                life.copied(r, CLIENT_COPY)
            elif r.lease is not None and r.lease.has(WRITERS) and r.jobs_pending:
                life.job_done(r, "/f", rng.random() > 0.1, {"path": "/f"}, 1, "EIO", 5)
            elif r.lease is not None and any(h.startswith("replica:") for h in r.lease.holds):
                holder = next(h for h in r.lease.holds if h.startswith("replica:"))[8:]
                life.replica_done(r, holder, rng.random() > 0.3, "down", 1)
            pending[r.id].clear()
        for r in requests:
            assert r.finished, f"request {r.id} stuck in {r.phase}"
            assert r.lease is None or r.lease.released
        extents = [r.lease.extent for r in requests if r.lease is not None]
        assert sorted(pool.returned, key=lambda e: e.offset) == sorted(extents, key=lambda e: e.offset)
        assert pool.free_bytes == pool.size and pool.waiting == 0
        assert table.saves_done + table.saves_failed + sum(
            r.phase == Phase.ABORTED for r in requests) == len(requests)


@pytest.mark.parametrize("ends_by", ["its STAGED", "its trainer leaving"])
def test_a_save_failed_by_its_staging_deadline_keeps_its_extent_until_the_copy_is_over(
        pool, ends_by):
    """A trainer past the staging deadline may be stopped mid-copy: when it resumes it
    writes into the extent it was given. That extent must not go to another save before
    the trainer says its copy is over (STAGED) or is gone."""
    table, fx, life = setup(pool)
    stopped, next_save = make(table, 6 * UNIT), make(table, 6 * UNIT)
    life.admit(stopped)
    life.fail(stopped, "staging did not finish", trainer_may_copy=True)
    assert stopped.phase == Phase.FAILED and stopped.lease.holds == {CLIENT_COPY}
    assert not life.admit(next_save), "the stopped trainer's extent was given to another save"
    if ends_by == "its STAGED":
        life.copied(stopped, CLIENT_COPY)
    else:
        life.trainer_gone(stopped)
    assert len(pool.returned) == 1 and fx.granted == [next_save.id]
    assert stopped.phase == Phase.FAILED and table.saves_failed == 1


def test_other_failures_free_the_trainers_share_at_once(pool):
    table, fx, life = setup(pool)
    request = make(table, 6 * UNIT)
    life.admit(request)
    life.fail(request, "ckptd is shutting down")
    assert len(pool.returned) == 1 and pool.free_bytes == pool.size


def test_a_request_forgotten_while_its_writers_work_leaves_the_table_when_they_answer(pool):
    # A trainer's give-up sends FORGET right after ABORT: the save must stay in status until
    # its writers answer and what they renamed into place has been removed.
    table, fx, life = setup(pool, jobs=1)
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    life.abort(request, "aborted")
    request.forget_when_written = True
    assert request.id in table.requests
    ok(life, request)
    assert fx.removed == [request.id] and request.id not in table.requests


def test_a_save_stopped_while_writing_cancels_its_writer_jobs_at_once(pool):
    # Removing the files when the writers answer is too late: one that renames meanwhile
    # shows the stopped save at its path. The writers are told at the stop itself.
    table, fx, life = setup(pool, jobs=1)
    request = make(table)
    life.admit(request)
    life.copied(request, CLIENT_COPY)
    assert fx.writes_cancelled == []
    life.abort(request, "the trainer gave up waiting")
    assert fx.writes_cancelled == [request.id] and fx.removed == []
    life.job_done(request, "/ckpt/x/f0", False, None, 10, "dropped", 125)
    assert fx.removed == [request.id] and table.saves_done == 0


def test_a_save_stopped_before_writing_has_no_writer_jobs_to_cancel(pool):
    table, fx, life = setup(pool, jobs=1)
    request = make(table)
    life.admit(request)
    life.abort(request, "aborted")
    assert fx.writes_cancelled == [] and fx.removed == [request.id]


def test_staging_ends_when_the_trainer_says_its_copy_ended_not_when_staged_arrives(pool):
    """A trainer that does not wait for STAGED's reply has returned before the daemon
    reads it: the staging's end (trace, log, histogram) is the copy's end it reported,
    kept between the grant and now (a reading from the future or before the grant is
    not taken as is)."""
    import time

    from ckptd.server.saves import _copy_ended

    table, fx, life = setup(pool)
    request = make(table)
    assert life.admit(request)
    copied_at = time.time()  # the copy ended after the grant; STAGED arrives later
    ended = _copy_ended(request, copied_at)
    life.copied(request, CLIENT_COPY, ended_at=ended)
    assert request.staged_at == copied_at
    assert _copy_ended(request, None) is None
    assert _copy_ended(request, 0.0) == (request.granted_at or request.created_at)
    assert _copy_ended(request, time.time() + 3600) <= time.time()


def test_every_phase_change_is_reported_once_in_order(pool):
    """The one phase setter tells the effects of each change (held POLLs wait on it),
    whichever path the save takes: queued for space, staged, written, or aborted."""
    table, fx, life = setup(pool)
    first, second = make(table, 6 * UNIT), make(table, 4 * UNIT)
    life.admit(first)
    life.admit(second)
    life.copied(first, CLIENT_COPY)
    ok(life, first)
    life.abort(second, "dropped")
    assert fx.phases == [(first.id, Phase.STAGING), (second.id, Phase.WAITING_FOR_POOL),
                         (first.id, Phase.WRITING), (first.id, Phase.DONE),
                         (second.id, Phase.STAGING), (second.id, Phase.ABORTED)]
