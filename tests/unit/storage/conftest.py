"""Fixtures of the storage tests: a staging pool file, and a writer over it."""

import os

import pytest

from ckptd.storage.writer_process import Writer

POOL_SIZE = 1 << 20


@pytest.fixture
def pool_path(tmp_path):
    """A 1 MiB pool file in /dev/shm, as the daemon's staging pool is (removed after)."""
    path = f"/dev/shm/ckptd-test-pool-{os.getpid()}-{tmp_path.name}"
    with open(path, "wb") as f:
        f.truncate(POOL_SIZE)
    yield path
    os.unlink(path)


@pytest.fixture
def writer(pool_path):
    """A :class:`Writer` executing jobs in this process against :func:`pool_path`."""
    return Writer(pool_path, POOL_SIZE)
