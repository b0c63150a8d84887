"""NUMA placement: sysfs facts, the node a save is near, and a pool cut into bound regions.

This machine has one node, so the multi-node facts come from a sysfs tree written under
``tmp_path`` (the same files the kernel exposes), and the binding is checked for real by
binding two regions to node 0 and reading ``/proc/self/numa_maps``.
"""

from __future__ import annotations

import os

import pytest

from ckptd.protocol import EXTENT_ALIGNMENT
from ckptd.staging import numa
from ckptd.staging.pool import Extent, Region, StagingPool

UNIT = EXTENT_ALIGNMENT


def write(root, relative: str, text: str) -> None:
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text + "\n")


@pytest.fixture
def two_sockets(tmp_path):
    """A two-node machine: our CPUs all on node 0, one GPU on each node."""
    ours = sorted(os.sched_getaffinity(0))
    write(tmp_path, "devices/system/node/online", "0-1")
    write(tmp_path, "devices/system/node/node0/cpulist", f"{ours[0]}-{ours[-1]}")
    write(tmp_path, "devices/system/node/node1/cpulist", f"{ours[-1] + 1}-{ours[-1] + 8}")
    write(tmp_path, "bus/pci/devices/0000:1b:00.0/numa_node", "0")
    write(tmp_path, "bus/pci/devices/0000:9c:00.0/numa_node", "1")
    write(tmp_path, "bus/pci/devices/0000:3a:00.0/numa_node", "-1")
    return str(tmp_path)


def test_cpulists_parse_as_sysfs_writes_them():
    assert numa.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa.parse_cpulist("") == set()


def test_nodes_and_devices_are_read_from_sysfs(two_sockets, tmp_path):
    write(two_sockets, "status", "Mems_allowed_list:\t0-1\n")
    assert numa.online_nodes(two_sockets, os.path.join(two_sockets, "status")) == [0, 1]
    assert numa.pci_node(0, 0x9C, 0, two_sockets) == 1
    assert numa.pci_node(0, 0x3A, 0, two_sockets) is None, "-1 means no affinity"
    assert numa.pci_node(0, 0x77, 0, two_sockets) is None, "an unknown device"
    assert numa.online_nodes(str(tmp_path / "nowhere")) == [0], "no NUMA info: one node"


def test_nodes_without_cpus_or_outside_our_cpuset_get_no_region(tmp_path):
    write(tmp_path, "devices/system/node/online", "0-2")
    write(tmp_path, "devices/system/node/has_cpu", "0-1")       # node 2: a GPU's HBM
    write(tmp_path, "devices/system/node/has_memory", "0-2")
    write(tmp_path, "status", "Name:\tckptd\nMems_allowed_list:\t0-2\n")
    assert numa.online_nodes(str(tmp_path), str(tmp_path / "status")) == [0, 1]
    write(tmp_path, "status", "Mems_allowed_list:\t1\n")       # a cpuset of node 1 only
    assert numa.online_nodes(str(tmp_path), str(tmp_path / "status")) == [1]


def test_a_save_is_near_its_gpu_else_its_process(two_sockets):
    place = numa.Placement([0, 1], {"GPU-a": 0, "GPU-b": 1}, sysfs=two_sockets)
    on_b = [None, {"device_uuid": "GPU-b"}]
    assert place.near(on_b, os.getpid()) == 1, "the GPU's node, not the process's"
    assert place.near(None, os.getpid()) == 0, "every CPU we may run on is on node 0"
    assert place.near([{"device_uuid": "GPU-unknown"}], os.getpid()) == 0
    assert numa.Placement([0], sysfs=two_sockets).near(on_b, os.getpid()) is None


def test_a_process_spread_over_nodes_is_near_none(tmp_path):
    ours = sorted(os.sched_getaffinity(0))
    if len(ours) < 2:
        pytest.skip("needs two CPUs to spread a process over two nodes")
    write(tmp_path, "devices/system/node/node0/cpulist", str(ours[0]))
    write(tmp_path, "devices/system/node/node1/cpulist", ",".join(map(str, ours[1:])))
    assert numa.Placement([0, 1], sysfs=str(tmp_path)).near(None, os.getpid()) is None


def numa_maps_of(path: str) -> list[str]:
    with open("/proc/self/numa_maps") as f:
        return [line for line in f if f"file={path}" in line]


def test_each_region_is_bound_to_its_node_before_its_pages_exist(tmp_path):
    path = f"/dev/shm/ckptd-test-numa-{os.getpid()}-{tmp_path.name}"
    pool = StagingPool(path, 64 * UNIT, nodes=[0, 0])  # the only node here, twice
    try:
        assert pool.regions == [Region(0, 32 * UNIT, 0), Region(32 * UNIT, 64 * UNIT, 0)]
        lines = numa_maps_of(path)
        assert lines and all(" prefer:0 " in line for line in lines), lines
        assert all("N0=" in line for line in lines), "the reserved pages are on node 0"
    finally:
        pool.close()
    plain = StagingPool(path, 8 * UNIT)
    try:
        assert plain.regions == [] and all(" default " in line for line in numa_maps_of(path))
    finally:
        plain.close()


def test_a_binding_the_kernel_refuses_leaves_no_region_bound(tmp_path):
    path = f"/dev/shm/ckptd-test-numa-{os.getpid()}-{tmp_path.name}"
    pool = StagingPool(path, 64 * UNIT, nodes=[0, 63])  # node 0 binds, node 63 does not exist
    try:
        assert pool.regions == [] and all(" default " in line for line in numa_maps_of(path))
    finally:
        pool.close()


@pytest.fixture
def split_pool(tmp_path):
    """A pool whose two halves the allocator treats as nodes 0 and 1 (one node here)."""
    pools = []

    def make(units: int) -> StagingPool:
        pool = StagingPool(f"/dev/shm/ckptd-test-numa-{os.getpid()}-{tmp_path.name}",
                           units * UNIT)
        pool.regions = [Region(0, units // 2 * UNIT, 0), Region(units // 2 * UNIT, units * UNIT, 1)]
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_an_extent_lands_in_the_region_of_its_node_else_anywhere(split_pool):
    pool = split_pool(16)
    first = pool.try_allocate(3 * UNIT, near=1)
    assert first == Extent(8 * UNIT, 3 * UNIT) and pool.node_of(first) == 1
    assert pool.try_allocate(UNIT, near=0) == Extent(0, UNIT)
    spill = pool.try_allocate(6 * UNIT, near=1)  # 5 units left on node 1: node 0 lends
    assert spill == Extent(UNIT, 6 * UNIT) and pool.node_of(spill) == 0
    for extent in (first, spill):
        pool.release(extent)
    assert pool.try_allocate(8 * UNIT, near=1) == Extent(8 * UNIT, 8 * UNIT)


def test_a_waiter_takes_the_first_space_that_comes_back_near_or_not(split_pool):
    pool = split_pool(4)
    node0, node1 = pool.try_allocate(2 * UNIT, near=0), pool.try_allocate(2 * UNIT, near=1)
    pool.wait_for(UNIT, "near 1", near=1)
    assert pool.release(node1) == [("near 1", Extent(2 * UNIT, UNIT))]
    pool.wait_for(2 * UNIT, "near 1 again", near=1)  # node 1 has one unit left
    assert pool.release(node0) == [("near 1 again", Extent(0, 2 * UNIT))], \
        "waiting for the own node would be worse than a remote one"
