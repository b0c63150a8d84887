"""The writer pool's dispatch, with real writer processes on real ipc channels."""

import os
import shutil
import tempfile
import time

import pytest
import zmq

from ckptd.storage.jobs import WriteBytes, WriteItems, WriteJob
from ckptd.storage.writer_pool import WriterPool

from pool_fixtures import POOL_SIZE, pool_path  # noqa: F401 (fixture)


@pytest.fixture
def pool(pool_path):
    """Two live writers; the test plays the serve loop (nothing is read unless it asks)."""
    context = zmq.Context()
    runtime_dir = tempfile.mkdtemp(prefix="ckw-")  # short: ipc paths have a length limit
    writers = WriterPool(2, context, runtime_dir, pool_path, POOL_SIZE, log_level="WARNING")
    try:
        writers.wait_ready(30)
        yield writers
    finally:
        writers.stop()
        context.term()
        shutil.rmtree(runtime_dir, ignore_errors=True)


def job(tmp_path, name, results, deadline=None):
    data = name.encode()
    made = WriteJob(WriteBytes(str(tmp_path / name), len(data)),
                    lambda j, result: results.__setitem__(name, result), frames=[data])
    made.deadline = deadline
    return made


def test_a_deadline_job_is_not_starved_by_later_jobs(pool, tmp_path):
    # Both writers busy, a commit (deadline) waits for an idle one. Later jobs must not
    # keep going to the writer that is about to become idle: it is kept for the commit,
    # which it takes as soon as it has answered what it had.
    results = {}
    first, second = job(tmp_path, "a", results), job(tmp_path, "b", results)
    pool.submit(first)
    pool.submit(second)
    assert {first.writer, second.writer} == {0, 1}
    commit = job(tmp_path, ".metadata", results, deadline=time.monotonic() + 60)
    pool.submit(commit)
    later = [job(tmp_path, f"later-{i}", results) for i in range(4)]
    for each in later:
        pool.submit(each)
    kept = pool.slots[first.writer]
    assert commit.writer == -1 and list(kept.jobs.values()) == [first]
    assert all(each.writer == second.writer for each in later)
    deadline = time.monotonic() + 30
    while ".metadata" not in results:  # the serve loop, for the kept writer only
        assert time.monotonic() < deadline, f"the commit never finished: {results}"
        if kept.socket.poll(100):
            pool.handle(kept.socket)
    assert results["a"].ok and results[".metadata"].ok
    assert commit.writer == first.writer
    assert os.path.exists(tmp_path / ".metadata")


def serve_until(pool, done, what: str) -> None:
    """Play the serve loop for every writer until ``done()``."""
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        for slot in pool.slots:
            if slot.socket.poll(20):
                pool.handle(slot.socket)


def test_jobs_sent_ahead_spread_over_the_writers_and_hold_no_commit_back(pool, tmp_path):
    # Held jobs (sent ahead while their saves stage) go one to each writer, as their files
    # will be written side by side; but a writer holding only those is idle: a commit with
    # a deadline goes at once and is written while they wait for their start.
    results = {}
    held = []
    for name in ("f0.distcp", "f1.distcp"):
        made = WriteJob(WriteItems(str(tmp_path / name), name, [[0, 16, "bytes", [16]]], 16),
                        lambda j, result, name=name: results.__setitem__(name, result))
        made.held = True
        pool.submit(made)
        held.append(made)
    assert {made.writer for made in held} == {0, 1}
    commit = job(tmp_path, ".metadata", results, deadline=time.monotonic() + 60)
    pool.submit(commit)
    assert commit.writer in (0, 1)
    serve_until(pool, lambda: ".metadata" in results, "the commit")
    assert results[".metadata"].ok and set(results) == {".metadata"}
    for made in held:
        pool.start(made)
    serve_until(pool, lambda: len(results) == 3, "the jobs started")
    assert all(result.ok for result in results.values())
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(".ckptd-sum")) == \
        [".metadata", "f0.distcp", "f1.distcp"]


def test_a_held_job_started_goes_behind_the_jobs_its_writer_took_meanwhile(pool, tmp_path):
    # A writer runs jobs in the order they become runnable; the stall check blames the
    # first one in its line, so a held job started later must stand behind the ones its
    # writer took while it waited (else a hung later job would be blamed on it).
    results = {}
    held = WriteJob(WriteItems(str(tmp_path / "h.distcp"), "h.distcp", [[0, 16, "bytes", [16]]],
                               16), lambda j, result: results.__setitem__("h.distcp", result))
    held.held = True
    pool.submit(held)
    others = [job(tmp_path, name, results) for name in ("b", "c")]
    for made in others:
        pool.submit(made)
    beside = [made for made in others if made.writer == held.writer]
    assert beside, "no plain job went to the held job's writer: the test shows nothing"
    pool.start(held)
    line = list(pool.slots[held.writer].jobs)
    assert line[-1] == held.id and line[0] == beside[0].id
    serve_until(pool, lambda: len(results) == 3, "the jobs")
    assert all(result.ok for result in results.values())
