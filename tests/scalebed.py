"""Many-node beds (8 to 32 nodes): where ranks go, what they do, and what a daemon costs.

Shared by ``tests/integration/test_scale_netbed.py`` and ``benchmarks/bench_scale.py``:

- :func:`layout` places ranks on nodes so that clique mates always live on distinct
  nodes, one rank per node and a few more where the replication factor needs a multiple;
- :func:`save_timed` and :func:`load_timed` run inside a node as real ranks
  (``tests/bednodes.py``): a save through ``LocalCheckpointManager`` (find_latest first,
  so the daemons have the key table and dial their peers), and a restore that checks the
  loaded bytes against what was saved;
- :func:`daemon_cost` reads what a daemon holds from ``/proc`` (sockets, threads, RSS).

Ranks are kept small (parts of about 1 MiB, one torch thread); each still imports torch,
so its memory is measured and reported, not assumed.
"""

from __future__ import annotations

import math
import os
import time

#: A part of about 1 MiB: one tensor big enough for a frame, a few small ones.
SMALL = {"big_mib": 1, "small_tensors": 4}
SESSION = "scale"


def layout(nodes: int, factor: int, jump: int) -> list[int]:
    """The node of each rank: rank ``r`` on node ``r % nodes``, with as many ranks as the
    smallest multiple of ``jump * factor`` that gives every node one.

    A clique spans ``jump * (factor - 1) + 1`` consecutive ranks, fewer than ``nodes``,
    so its ranks land on distinct nodes.
    """
    if jump * (factor - 1) + 1 > nodes:
        raise ValueError(f"{nodes} nodes cannot hold cliques of factor {factor}, jump {jump} "
                         "on distinct nodes")
    block = jump * factor
    return [r % nodes for r in range(math.ceil(nodes / block) * block)]


def clique_nodes(placement: list[int], factor: int, jump: int) -> list[set[int]]:
    """For each node, the other nodes holding a rank of a clique of one of its ranks (whom
    its daemon replicates with)."""
    from ckpt_client import CliqueReplicationStrategy

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor, len(placement))
    mates: list[set[int]] = [set() for _ in range(max(placement) + 1)]
    for clique in strategy.cliques:
        nodes = {placement[r] for r in clique}
        for node in nodes:
            mates[node] |= nodes - {node}
    return mates


def _manager(rank: int, roots: list, jump: int, factor: int):
    from ckpt_client import CliqueReplicationStrategy, LocalCheckpointManager

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor)
    return LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)


def save_timed(rank: int, world: int, roots: list, jump: int, factor: int, iteration: int,
               size: dict) -> dict:
    """find_latest, then one asynchronous save finalized; seconds of each step."""
    from ckpt_client import AsyncCallsQueue, BasicTensorAwareStateDict
    from test_local_checkpoints import state_of

    manager = _manager(rank, roots, jump, factor)
    start = time.monotonic()
    manager.find_latest()
    registered = time.monotonic()
    queue = AsyncCallsQueue()
    request = manager.save(BasicTensorAwareStateDict(state_of(rank, iteration, **size)),
                           iteration, is_async=True)
    staged = time.monotonic()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    finalized = time.monotonic()
    queue.close()
    return {"find_latest_s": registered - start, "staged_s": staged - registered,
            "finalize_s": finalized - registered, "collective_s": _collective_seconds(),
            "report": manager.last_save_report, "rss": _rss(os.getpid())}


def _collective_seconds(repeats: int = 5) -> float:
    """Median seconds of the one-integer all-reduce a save's agreement costs, over gloo."""
    import statistics

    import torch
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        value = torch.zeros(1, dtype=torch.int64)
        start = time.monotonic()
        dist.all_reduce(value)
        times.append(time.monotonic() - start)
    return statistics.median(times)


def load_timed(rank: int, world: int, roots: list, jump: int, factor: int, size: dict) -> dict:
    """find_latest and load; the loaded state must equal what was saved, bit for bit."""
    from test_local_checkpoints import same, state_of

    manager = _manager(rank, roots, jump, factor)
    start = time.monotonic()
    latest = manager.find_latest()
    loaded, part_id = manager.load()
    seconds = time.monotonic() - start
    assert same(loaded.state_dict, state_of(rank, latest, **size)), \
        f"rank {rank}: the data loaded differs from what was saved"
    return {"latest": latest, "part_id": part_id, "report": manager.last_load_report,
            "seconds": seconds, "rss": _rss(os.getpid())}


def _rss(pid: int) -> int:
    return _status_field(pid, "VmRSS")


def _status_field(pid: int, name: str) -> int:
    """A ``/proc/PID/status`` field (kB fields in bytes; counts as they are); 0 if gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    value = line.split()[1]
                    return int(value) * (1024 if line.rstrip().endswith("kB") else 1)
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _sockets(pid: int) -> int:
    count = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
            except OSError:
                continue
    except FileNotFoundError:
        pass
    return count


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return 0


def daemon_cost(pid: int) -> dict:
    """What one daemon process holds now: sockets (every socket fd: peer links, bulk
    connections, the trainer socket, internal pipes), threads, RSS and PSS in bytes."""
    return {"sockets": _sockets(pid), "threads": _status_field(pid, "Threads"),
            "rss": _rss(pid), "pss": _pss(pid)}
