"""The writer pool's dispatch, with real writer processes on real ipc channels."""

import os
import shutil
import tempfile
import time

import pytest
import zmq

from ckptd.storage.jobs import WriteBytes, WriteJob
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
