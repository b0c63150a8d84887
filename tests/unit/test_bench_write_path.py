"""bench_write_path's disk request column on a workdir with no block device under it.

Real directories: /dev/shm (a tmpfs: no /sys/dev/block entry) and the test's own tmp_path.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "bench_write_path.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_write_path", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_workdir_on_no_block_device_gives_no_request_size_instead_of_a_crash(bench):
    assert bench.disk_of("/dev/shm") is None
    assert bench.disk_writes(None) is None
    assert bench.mean_request_kib(None, None) is None
    assert bench.mean_request_kib((10, 0), (12, 4096)) == 1024.0


def test_a_workdir_on_a_block_device_reads_its_counters(bench, tmp_path):
    disk = bench.disk_of(str(tmp_path))
    if disk is None:
        pytest.skip(f"{tmp_path} is on no block device here")
    requests, sectors = bench.disk_writes(disk)
    assert requests >= 0 and sectors >= 0
