"""NUMA placement of the staging pool: which node a save's bytes should land on.

Owns the node facts the pool needs, read from sysfs: the online nodes, the node of each
GPU (by its PCI address) and of each CPU, and the binding of a memory range to a node.
On a machine with several nodes the pool is cut into one region per node, each bound to
its node before its pages exist (``mbind``, preferred, not strict: a node short of memory
lends another's rather than failing). A save then takes an extent in the region of the
node its bytes come from: the node of the GPU it was exported from (device-to-host copies
cross no socket link), else the node its trainer process is pinned to.

A machine with one node (or without NUMA information) gets one region and no binding.
Only facts are read here; the allocator that uses them is :mod:`ckptd.staging.pool`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SYSFS = "/sys"
_MPOL_DEFAULT, _MPOL_PREFERRED = 0, 1
_NR_MBIND = {"x86_64": 237, "aarch64": 235}


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (sysfs list format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def online_nodes(sysfs: str = SYSFS, status: str = "/proc/self/status") -> list[int]:
    """The nodes a pool region can live on: online, with CPUs and memory (not a GPU's HBM
    or a CXL expander exposed as a node), and allowed by our cpuset. ``[0]`` where the
    kernel has no NUMA information."""
    nodes = None
    for name in ("online", "has_cpu", "has_memory"):
        text = _read(os.path.join(sysfs, "devices/system/node", name))
        if text is not None:
            found = parse_cpulist(text)
            nodes = found if nodes is None else nodes & found
    allowed = next((line.split(":", 1)[1] for line in (_read(status) or "").splitlines()
                    if line.startswith("Mems_allowed_list:")), None)
    if nodes is not None and allowed is not None:
        nodes &= parse_cpulist(allowed)
    return sorted(nodes) if nodes else [0]


def node_cpus(node: int, sysfs: str = SYSFS) -> set[int]:
    """The CPUs of ``node``."""
    text = _read(os.path.join(sysfs, f"devices/system/node/node{node}/cpulist"))
    return parse_cpulist(text) if text else set()


def pci_node(domain: int, bus: int, device: int, sysfs: str = SYSFS) -> int | None:
    """The node a PCI device is attached to, or ``None`` (unknown, or ``-1``: no affinity)."""
    text = _read(os.path.join(sysfs, f"bus/pci/devices/{domain:04x}:{bus:02x}:{device:02x}.0",
                              "numa_node"))
    try:
        node = int(text) if text else -1
    except ValueError:
        return None
    return node if node >= 0 else None


def bind_preferred(address: int, length: int, node: int | None) -> None:
    """Prefer ``node`` for the pages of ``[address, address + length)`` not allocated yet
    (``None``: back to the default policy).

    Raises
    ------
    OSError
        If the kernel refuses (no such node, no NUMA support).
    """
    import platform

    number = _NR_MBIND.get(platform.machine())
    if number is None:
        raise OSError(0, f"mbind is not known on {platform.machine()}")
    words = (node or 0) // 64 + 1
    mask = (ctypes.c_ulong * words)()
    if node is not None:
        mask[node // 64] = 1 << (node % 64)
    mode, maxnode = (_MPOL_PREFERRED, words * 64 + 1) if node is not None else (_MPOL_DEFAULT, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    # maxnode counts one more than the mask's bits: the kernel reads maxnode - 1 of them.
    if libc.syscall(ctypes.c_long(number), ctypes.c_void_p(address), ctypes.c_ulong(length),
                    ctypes.c_ulong(mode), mask if node is not None else None,
                    ctypes.c_ulong(maxnode), ctypes.c_ulong(0)) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mbind to NUMA node {node} failed: {os.strerror(error)}")


@dataclass
class Placement:
    """Which node a save should be staged on.

    Parameters
    ----------
    nodes : list of int
        The nodes the pool has a region for (one entry: no preference is ever given).
    device_nodes : dict
        GPU UUID -> node, for the devices the daemon sees.
    """

    nodes: list
    device_nodes: dict = field(default_factory=dict)
    sysfs: str = SYSFS

    def __post_init__(self) -> None:
        self._cpus = ({node: node_cpus(node, self.sysfs) for node in self.nodes}
                      if self.several else {})

    @property
    def several(self) -> bool:
        """Whether placement matters on this machine."""
        return len(self.nodes) > 1

    def near(self, cuda_specs: list | None, pid: int) -> int | None:
        """The node a save's bytes come from: its first GPU's, else its process's."""
        if not self.several:
            return None
        for spec in cuda_specs or ():
            if spec is not None and spec.get("device_uuid") in self.device_nodes:
                return self.device_nodes[spec["device_uuid"]]
        return self.process_node(pid)

    def process_node(self, pid: int) -> int | None:
        """The node whose CPUs hold every CPU ``pid`` may run on, if there is one."""
        try:
            allowed = os.sched_getaffinity(pid)
        except OSError:  # gone, or not ours to ask
            return None
        inside = [node for node, cpus in self._cpus.items() if cpus and allowed <= cpus]
        return inside[0] if len(inside) == 1 else None
