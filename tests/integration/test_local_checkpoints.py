"""Local checkpoints end to end: real daemons as "nodes" on 127.0.0.x, real gloo ranks.

Each node is a ``ckptd serve`` with its own ``--local-dir`` and ``--peer-listen`` on its
own loopback address; ranks are spawned processes pointed at their node's daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import _remove_pool_of, free_port, start_daemon_process, wait_for
from multirank import collect, run_ranks, start_ranks, values

SESSION = "job1"
PEER_ENV = {"CKPTD_PEER_TIMEOUT": "8", "CKPTD_PEER_PING_INTERVAL": "0.5"}
#: For tests where a push must fail without progress (a frozen peer): that
#: deadline is waited out on purpose, and a small part on loopback moves far within 3 s.
SHORT_PEER_ENV = {**PEER_ENV, "CKPTD_PEER_TIMEOUT": "3"}


# ---------------------------------------------------------------- helpers (also used by ranks)

#: Parts bigger than a few replication frames (4 MiB), plus many small tensors that
#: share frames, so streams need several frames and acknowledgements.
BIG = {"big_mib": 18, "small_tensors": 300}


def state_of(rank: int, iteration: int, big_mib: int = 0, small_tensors: int = 0) -> dict:
    """A state dict whose every value depends on rank and iteration."""
    g = torch.Generator().manual_seed(rank * 1000 + iteration)
    extra = {"big": torch.randn(big_mib * (1 << 18), generator=g)} if big_mib else {}
    extra.update({f"small{i}": torch.full((i % 7 + 1,), i + rank, dtype=torch.int32)
                  for i in range(small_tensors)})
    return {"model": {**extra, "w": torch.randn(64, 32, generator=g),
                      "b": torch.arange(10, dtype=torch.int64) + rank,
                      "half": torch.full((3,), float(rank), dtype=torch.bfloat16),
                      "empty": torch.empty(0, 4)},
            "step": iteration, "name": f"rank{rank}",
            "extra": [torch.tensor(float(iteration)), (1, "x", None)]}


def same(a, b) -> bool:
    """Structural equality, tensors compared by dtype, shape and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


class Nodes:
    """Several daemons, each a "node" with its own loopback address, local dir and socket
    (kept across restarts, as a SLURM prolog would)."""

    def __init__(self, tmp_path, count: int, env=None) -> None:
        self.tmp_path, self.env = tmp_path, env or PEER_ENV
        self.dirs = [str(tmp_path / f"node{n}") for n in range(count)]
        self.addresses = [f"tcp://127.0.0.{n + 1}:{free_port()}" for n in range(count)]
        self.started: list = []
        self.daemons = [self._start(n) for n in range(count)]

    def _start(self, n: int):
        os.makedirs(self.dirs[n], exist_ok=True)
        daemon = start_daemon_process(
            self.tmp_path, name=f"n{n}", pool_size="128M", env=self.env,
            extra_args=["--local-dir", self.dirs[n], "--peer-listen", self.addresses[n]])
        self.started.append(daemon)
        return daemon

    def restart(self, n: int, wipe: bool = False) -> None:
        """SIGKILL node ``n``'s daemon (optionally losing its disk), start it again."""
        self.daemons[n].stop(signal.SIGKILL)
        _remove_pool_of(self.daemons[n])
        if wipe:
            shutil.rmtree(self.dirs[n])
        self.daemons[n] = self._start(n)

    def stop_all(self) -> None:
        for daemon in self.started:
            daemon.stop(signal.SIGKILL if daemon.process.poll() is None else signal.SIGTERM, 30)
            _remove_pool_of(daemon)

    def sockets(self, ranks_per_node: int) -> list:
        return [d.socket for d in self.daemons for _ in range(ranks_per_node)]

    def roots(self, ranks_per_node: int) -> list:
        return [os.path.join(d, "ckpt") for d in self.dirs for _ in range(ranks_per_node)]

    def part(self, node: int, iteration: int, owner: int) -> str:
        return os.path.join(self.dirs[node], "ckpt", SESSION, f"iter_{iteration:07d}",
                            f"rank_{owner}.part")


@pytest.fixture
def make_nodes(tmp_path):
    """Factory: ``make_nodes(count) -> Nodes``; every daemon is stopped afterwards."""
    made: list[Nodes] = []

    def make(count: int, env=None) -> Nodes:
        made.append(Nodes(tmp_path, count, env))
        return made[-1]

    yield make
    for nodes in made:
        nodes.stop_all()


# ---------------------------------------------------------------- rank functions

def save_find_load(rank, world_size, roots, jump, factor, iterations, is_async, size=None):
    from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    assert manager.find_latest() == -1
    reports = []
    for iteration in iterations:
        state = state_of(rank, iteration, **(size or {}))
        if is_async:
            queue = AsyncCallsQueue()
            request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
            for tensor in state["model"].values():
                tensor.zero_()  # staged already: must not reach the checkpoint
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            queue.close()
        else:
            assert manager.save(BasicTensorAwareStateDict(state), iteration) is None
        reports.append(manager.last_save_report)
    latest = manager.find_latest()
    loaded, part_id = manager.load()
    expected = state_of(rank, latest, **(size or {}))
    assert same(loaded.state_dict, expected), f"rank {rank}: wrong data loaded"
    return latest, part_id, reports, manager.last_load_report


def find_and_load(rank, world_size, roots, jump, factor, size=None):
    from ckpt_client import CliqueReplicationStrategy, LocalCheckpointManager

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    latest = manager.find_latest()
    loaded, part_id = manager.load()
    expected = state_of(rank, latest, **(size or {}))
    assert same(loaded.state_dict, expected), f"rank {rank}: wrong data loaded"
    return latest, part_id, manager.last_load_report


def register_only(rank, world_size, roots):
    from ckpt_client import CheckpointException, CliqueReplicationStrategy, LocalCheckpointManager

    strategy = CliqueReplicationStrategy.from_replication_params(1, world_size)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    try:
        manager.find_latest()
    except CheckpointException as exc:
        return exc.failing_ranks, str(exc)
    return None


def save_across_daemon_restart(rank, world_size, roots, flags):
    import torch.distributed as dist

    from ckpt_client import (BasicTensorAwareStateDict, CheckpointException,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    manager.save(BasicTensorAwareStateDict(state_of(rank, 1)), 1)
    if rank == 1:
        open(flags["saved"], "w").close()
        while not os.path.exists(flags["restarted"]):  # the test restarts node 1's daemon
            time.sleep(0.02)
    dist.barrier()
    try:
        manager.save(BasicTensorAwareStateDict(state_of(rank, 2)), 2)
        refused = None
    except CheckpointException as exc:
        refused = (exc.failing_ranks, str(exc))
    latest = manager.find_latest()  # registers the session with the new daemon again
    manager.save(BasicTensorAwareStateDict(state_of(rank, 3)), 3)
    return refused, latest, manager.find_latest(), manager.last_save_report


def save_without_replication(rank, world_size, roots):
    from ckpt_client import BasicTensorAwareStateDict, LocalCheckpointManager

    manager = LocalCheckpointManager(roots[rank], session_id=SESSION)
    manager.save(BasicTensorAwareStateDict(state_of(rank, 7)), 7)
    latest = manager.find_latest()
    loaded, part_id = manager.load()
    assert same(loaded.state_dict, state_of(rank, 7))
    return latest, part_id, manager.last_save_report


# ---------------------------------------------------------------- tests

@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_save_find_load_two_nodes(make_nodes, tmp_path, is_async):
    nodes = make_nodes(2)
    # 2 nodes x 2 ranks; jump 2 = ranks per node, so cliques (0,2) and (1,3) span nodes
    outcomes = run_ranks(save_find_load, 4, nodes.sockets(2), tmp_path,
                         args=(nodes.roots(2), 2, 2, [1, 2], is_async, BIG))
    for rank, (latest, part_id, reports, load_report) in enumerate(values(outcomes)):
        assert latest == 2 and part_id == (2, rank, SESSION)
        # the daemon still keeps the latest committed part in its memory
        assert load_report["source"] == "daemon_memory" and load_report["holder"] is None
        assert load_report["bytes"] > 0 and load_report["seconds"] > 0
        for report in reports:
            assert not report["reduced_redundancy"], report
            assert report["replicated_to"] == [nodes.addresses[1 - rank // 2]]
            assert report["copies"] == [nodes.addresses[rank // 2], nodes.addresses[1 - rank // 2]]
            assert report["wanted_copies"] == 2
    for node in range(2):
        for owner in range(4):  # own parts and the clique mates' replicas on both nodes
            assert os.path.exists(nodes.part(node, 2, owner))
        # iteration 1 was removed once every rank committed iteration 2
        assert not os.path.exists(os.path.dirname(nodes.part(node, 1, 0)))
    doc = nodes.daemons[0].status()
    held = {(p["owner"], p["kind"]) for p in doc["local_checkpoints"] if p["iteration"] == 2}
    assert held == {(0, "own"), (1, "own"), (2, "replica"), (3, "replica")}
    assert all(p["verified"] for p in doc["local_checkpoints"])
    assert [p["address"] for p in doc["peers"]] == [nodes.addresses[1]]
    wait_for(lambda: nodes.daemons[0].status()["peers"][0]["health"] == "up", 30, "peer up")
    # The timeline shows each own part's stream to its peer, inside the save, after staging
    trace = tmp_path / "trace.json"
    run = subprocess.run([sys.executable, "-m", "ckptd", "trace", "--socket",
                          nodes.daemons[0].socket, "--last", "1", "--out", str(trace)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    events = json.load(open(trace))["traceEvents"]
    pushes = {e["args"]["rank"]: e for e in events if e.get("cat") == "replication"}
    assert sorted(pushes) == [0, 1], pushes
    stagings = {e["args"]["rank"]: e for e in events if e.get("cat") == "staging"}
    for rank, push in pushes.items():
        assert push["name"] == f"replicate rank {rank} -> {nodes.addresses[1]}"
        assert push["args"]["state"] == "done" and push["args"]["bytes"] > 0
        assert push["ts"] >= stagings[rank]["ts"] + stagings[rank]["dur"]


def test_lost_node_is_restored_from_peers(make_nodes, tmp_path):
    nodes = make_nodes(4)
    # 4 nodes x 2 ranks, jump 2, factor 2: cliques (0,2) (1,3) (4,6) (5,7)
    values(run_ranks(save_find_load, 8, nodes.sockets(2), tmp_path,
                     args=(nodes.roots(2), 2, 2, [5], False), timeout=400, name="save"))
    nodes.restart(1, wipe=True)  # node 1 (ranks 2, 3) lost its disk
    assert not os.path.exists(nodes.part(1, 5, 2))
    outcomes = values(run_ranks(find_and_load, 8, nodes.sockets(2), tmp_path,
                                args=(nodes.roots(2), 2, 2), timeout=400, name="load"))
    for rank, (latest, part_id, load_report) in enumerate(outcomes):
        assert latest == 5 and part_id == (5, rank, SESSION)
        if rank in (2, 3):
            assert (load_report["source"], load_report["holder"]) == ("peer", nodes.addresses[0])
        else:  # their daemons lived on, keeping the part in memory
            assert (load_report["source"], load_report["holder"]) == ("daemon_memory", None)
    # the restored parts are on node 1 again, verified
    for owner in (2, 3):
        assert os.path.exists(nodes.part(1, 5, owner))
    doc = nodes.daemons[1].status()
    assert {(p["owner"], p["verified"]) for p in doc["local_checkpoints"]} >= {(2, True), (3, True)}


def test_without_replication(make_nodes, tmp_path):
    nodes = make_nodes(2)
    outcomes = values(run_ranks(save_without_replication, 2, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1),)))
    for rank, (latest, part_id, report) in enumerate(outcomes):
        assert latest == 7 and part_id == (7, rank, SESSION)
        assert report["replicated_to"] == [] and not report["reduced_redundancy"]
    assert not os.path.exists(nodes.part(0, 7, 1))  # no replicas without a strategy


def test_root_outside_local_dir_is_refused_on_every_rank(make_nodes, tmp_path):
    nodes = make_nodes(2)
    roots = [nodes.roots(1)[0], str(tmp_path / "elsewhere")]
    for failing, text in values(run_ranks(register_only, 2, nodes.sockets(1), tmp_path,
                                          args=(roots,))):
        assert failing == [1]
        assert "outside the allowed roots" in text and "--local-dir" in text


def test_daemon_restart_refuses_saves_until_find_latest(make_nodes, tmp_path):
    # Rank 0's second save pushes to the restarted node, which no longer knows the
    # session: that push fails (nothing listens at the bulk address the key table names),
    # here at its 3 s no-progress deadline, before refused dials would count as the peer
    # gone.
    nodes = make_nodes(2, env=SHORT_PEER_ENV)
    flags = {name: str(tmp_path / name) for name in ("saved", "restarted")}
    processes, results = start_ranks(save_across_daemon_restart, 2, nodes.sockets(1), tmp_path,
                                     args=(nodes.roots(1), flags))
    wait_for(lambda: os.path.exists(flags["saved"]), 300, "the first save")
    nodes.restart(1)  # same socket, same disk, new CURVE key, no session
    open(flags["restarted"], "w").close()
    for refused, latest, final, report in values(collect(processes, results, timeout=300)):
        failing, text = refused
        assert failing == [1] and "not registered" in text and "find_latest()" in text
        assert latest == 1  # the restarted node kept its disk
        assert final == 3 and not report["reduced_redundancy"]


def test_single_process_without_a_process_group(start_daemon, tmp_path):
    from ckpt_client import BasicTensorAwareStateDict, LocalCheckpointManager

    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    manager = LocalCheckpointManager(local_dir / "ckpt", socket=daemon.socket)
    assert manager.find_latest() == -1
    with pytest.raises(FileNotFoundError, match="no complete local checkpoint"):
        manager.load()
    for iteration in (4, 9):
        manager.save(BasicTensorAwareStateDict(state_of(0, iteration)), iteration)
    assert manager.find_latest() == 9
    loaded, part_id = manager.load()
    assert part_id == (9, 0, "") and same(loaded.state_dict, state_of(0, 9))
    assert sorted(os.listdir(local_dir / "ckpt")) == ["iter_0000009"]
    part = local_dir / "ckpt" / "iter_0000009" / "rank_0.part"
    with open(part, "r+b") as f:  # a corrupted own part is never loaded
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert manager.find_latest() == -1
