"""Local checkpoints across nodes that are really separate: a network-namespace bed.

Each node is its own network namespace with its own tmpfs (``tests/netbed.py``); its
``ckptd serve`` listens on ``tcp://0.0.0.0:PORT`` and must advertise its node's interface
address; ranks run inside their node (gloo over the node's veth), so parts, heartbeats
and collectives cross real links, rate-limited with ``tc tbf`` where a test needs it.
Faults by real means: SIGKILL, wiping a node's tmpfs, flipping a byte, ``ip link set
down``, a client holding a key the trainers never named. Where namespaces cannot be made
the bed falls back to 127.77.x.y addresses (printed), and tests that need a link of their
own (rates, cutting it) skip with the bed's reason.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest
import torch

from bednodes import ROOT, TESTS_DIR, BedNodes, values
from conftest import wait_for
from conftest_netbed import netbed  # noqa: F401  (the fixture)
from test_local_checkpoints import SESSION, state_of
from test_replication import flip_byte, load_with_corrupted_replica  # noqa: F401 (rank fn)

import peerclient

#: Knobs of every daemon in these tests (a stream without progress fails after 20 s).
BED_ENV = {"CKPTD_PEER_TIMEOUT": "20", "CKPTD_PEER_PING_INTERVAL": "0.5"}
#: Small parts: one 2 MiB tensor and a few small ones (several chunks are 4 MiB).
SMALL = {"big_mib": 2, "small_tensors": 20}


# ---------------------------------------------------------------- helpers (ranks use them too)

def bit_identical(a, b) -> bool:
    """Same structure, and every tensor the same dtype, shape and bytes."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.contiguous().view(-1).view(torch.uint8),
                                b.contiguous().view(-1).view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            bit_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(
            bit_identical(x, y) for x, y in zip(a, b))
    return a == b


def _manager(rank, roots, jump, factor):
    from ckpt_client import CliqueReplicationStrategy, LocalCheckpointManager

    strategy = (CliqueReplicationStrategy.from_replication_params(jump, factor)
                if factor > 1 else None)
    return LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)


def save_iterations(rank, world_size, roots, jump, factor, iterations, size):
    from ckpt_client import BasicTensorAwareStateDict

    manager = _manager(rank, roots, jump, factor)
    reports = []
    for iteration in iterations:
        manager.save(BasicTensorAwareStateDict(state_of(rank, iteration, **size)), iteration)
        reports.append(manager.last_save_report)
    return reports


def load_latest(rank, world_size, roots, jump, factor, size):
    manager = _manager(rank, roots, jump, factor)
    latest = manager.find_latest()
    loaded, part_id = manager.load()
    assert bit_identical(loaded.state_dict, state_of(rank, latest, **size)), \
        f"rank {rank}: the data loaded differs from what was saved"
    return latest, part_id, manager.last_load_report


def load_expecting_no_checkpoint(rank, world_size, roots, jump, factor):
    manager = _manager(rank, roots, jump, factor)
    latest = manager.find_latest()
    try:
        manager.load()
    except FileNotFoundError as exc:
        return latest, str(exc)
    return latest, None


@pytest.fixture
def bed_nodes(netbed, tmp_path):  # noqa: F811 (the netbed fixture)
    """Factory: ``bed_nodes(count, rate=None, env=None, require_netns=False) -> BedNodes``."""
    made: list[BedNodes] = []

    def make(count: int, rate: str | None = None, env: dict | None = None,
             require_netns: bool = False) -> BedNodes:
        bed = netbed(count, rate=rate, tmpfs_size="256m", require_netns=require_netns)
        print(f"bed {bed.name}: {bed.mode} ({bed.mode_reason})")
        workdir = tmp_path / f"bed{len(made)}"
        workdir.mkdir()
        made.append(BedNodes(bed, str(workdir), env={**BED_ENV, **(env or {})}))
        return made[-1]

    yield make
    for nodes in made:
        nodes.stop_all()


def roots_of(nodes: BedNodes, placement: list[int]) -> list[str]:
    return [nodes.root(node) for node in placement]


# ---------------------------------------------------------------- tests

def test_daemons_advertise_their_node_address_not_loopback(bed_nodes):
    nodes = bed_nodes(2, require_netns=True)  # on 127.x it would check what it set
    for i, node in enumerate(nodes.bed.nodes):
        replication = nodes.status(i)["replication"]
        assert replication["address"].startswith(f"tcp://{node.ip}:"), replication
        assert replication["bulk_address"].startswith(f"{node.ip}:")
        assert replication["encryption"] == "aes-256-gcm"


def test_a_slow_link_replicates_every_save(bed_nodes):
    # Liveness budget: 3 missed heartbeats of 0.2 s = 0.6 s. Each 16 MiB part needs at
    # least 1.3 s on a 100 Mbit/s link, and both nodes push at once.
    nodes = bed_nodes(2, rate="100mbit", require_netns=True,
                      env={"CKPTD_PEER_PING_INTERVAL": "0.2", "CKPTD_PEER_MISS_BUDGET": "3"})
    placement = [0, 1]
    addresses = [nodes.address(0), nodes.address(1)]
    reports = values(nodes.run_ranks(save_iterations, placement,
                                     args=(roots_of(nodes, placement), 1, 2, [1, 2, 3],
                                           {"big_mib": 16})))
    for rank, rank_reports in enumerate(reports):
        for report in rank_reports:
            assert not report["reduced_redundancy"], report
            assert report["copies"] == [addresses[rank], addresses[1 - rank]]
    for node in (0, 1):
        for owner in (0, 1):
            assert os.path.exists(nodes.part(node, SESSION, 3, owner))
        peers = nodes.status(node)["peers"]
        assert [p["streams_failed"] for p in peers] == [0], peers


FOUR_NODES = [
    # (replication factor, jump, node of each rank): clique mates on distinct nodes
    pytest.param(2, 2, [0, 0, 1, 1, 2, 2, 3, 3], id="factor2-jump2-two-ranks-per-node"),
    # slow: the default suite already proves what it adds, on this bed: a factor-3 part
    # restored from a peer after its node's disk is wiped (the flipped-byte test below),
    # and a lost node whose ranks belong to two cliques (the case above); saves 20-25 s.
    pytest.param(3, 1, [0, 1, 2, 3, 0, 1], id="factor3-jump1", marks=pytest.mark.slow),
    pytest.param(2, 1, [0, 1, 2, 3], id="factor2-jump1", marks=pytest.mark.slow),
    pytest.param(3, 2, [0, 3, 1, 0, 2, 1], id="factor3-jump2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("factor,jump,placement", FOUR_NODES)
def test_four_nodes_lose_one_and_every_rank_loads_bit_identical_data(bed_nodes, factor, jump,
                                                                     placement):
    nodes = bed_nodes(4)
    roots = roots_of(nodes, placement)
    addresses = [nodes.address(i) for i in range(4)]
    saved = values(nodes.run_ranks(save_iterations, placement,
                                   args=(roots, jump, factor, [1, 2], SMALL), name="save"))
    for rank, reports in enumerate(saved):
        copies = reports[-1]["copies"]
        assert len(set(copies)) == factor == reports[-1]["wanted_copies"], reports[-1]
        assert copies[0] == addresses[placement[rank]] and not reports[-1]["reduced_redundancy"]
    nodes.restart(1, wipe=True)  # node 1's daemon killed, its directory wiped
    loaded = values(nodes.run_ranks(load_latest, placement, args=(roots, jump, factor, SMALL),
                                    name="load"))
    for rank, (latest, part_id, report) in enumerate(loaded):
        assert latest == 2 and part_id == (2, rank, SESSION)
        if placement[rank] == 1:
            assert report["source"] == "peer" and report["holder"] in addresses, report
            assert os.path.exists(nodes.part(1, SESSION, 2, rank)), "restored on its node"
        else:  # their daemons lived on and kept the part in memory
            assert (report["source"], report["holder"]) == ("daemon_memory", None), report


def test_a_replica_with_a_flipped_byte_is_never_used(bed_nodes):
    nodes = bed_nodes(3)  # 3 nodes x 1 rank, one clique (0, 1, 2)
    placement = [0, 1, 2]
    roots = roots_of(nodes, placement)
    values(nodes.run_ranks(save_iterations, placement, args=(roots, 1, 3, [4], SMALL),
                           name="save"))
    nodes.restart(0, wipe=True)
    corrupt = nodes.part(1, SESSION, 4, 0)  # the first holder's replica of rank 0
    outcomes = values(nodes.run_ranks(load_with_corrupted_replica, placement,
                                      args=(roots, corrupt, 1, 3, SMALL), name="load"))
    latest, error, report, again = outcomes[0]
    assert latest == 4 and error is None, error  # rank 0 checked its data equals the save
    assert (report["source"], report["holder"]) == ("peer", nodes.address(2))
    assert [t["holder"] for t in report["tried"]] == [nodes.address(1)]
    assert "corrupted" in report["tried"][0]["error"]
    assert again == 4
    bad = [p for p in nodes.status(1)["local_checkpoints"] if p["owner"] == 0]
    assert bad and bad[0]["verified"] is False


def test_losing_every_node_of_a_clique_is_a_clear_error_not_a_hang(bed_nodes):
    nodes = bed_nodes(4)  # 4 nodes x 1 rank, factor 2, jump 1: cliques (0, 1) and (2, 3)
    placement = [0, 1, 2, 3]
    roots = roots_of(nodes, placement)
    values(nodes.run_ranks(save_iterations, placement, args=(roots, 1, 2, [3], SMALL),
                           name="save"))
    nodes.restart(0, wipe=True)
    nodes.restart(1, wipe=True)
    outcomes = values(nodes.run_ranks(load_expecting_no_checkpoint, placement,
                                      args=(roots, 1, 2), timeout=240, name="load"))
    for latest, error in outcomes:
        assert latest == -1
        assert error and "iteration 3 was committed" in error and "ranks [0, 1]" in error, error


def _request_of(nodes: BedNodes, node: int) -> dict | None:
    requests = [r for r in nodes.status(node)["requests"] if r["format"] == "local"]
    return requests[-1] if requests else None


def test_a_link_cut_mid_transfer_reduces_redundancy_and_the_save_completes(bed_nodes):
    # 20 Mbit/s: a 32 MiB part takes ~14 s to cross, its first chunks half way; a stream
    # without progress for 4 s fails (a chunk on this slow link takes longer than that,
    # but its bytes keep moving)
    nodes = bed_nodes(2, rate="20mbit", require_netns=True, env={"CKPTD_PEER_TIMEOUT": "4"})
    placement = [0, 1]
    roots = roots_of(nodes, placement)
    addresses = [nodes.address(0), nodes.address(1)]
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outcomes=nodes.run_ranks(
        save_iterations, placement, args=(roots, 1, 2, [1], {"big_mib": 32}), timeout=240,
        name="save")))
    runner.start()
    try:
        def pushing():
            streams = nodes.status(0)["replication"]["streams"]
            return any(s["direction"] == "out" and 0 < s["bytes_done"] < s["size"]
                       for s in streams)

        wait_for(pushing, 120, "node 0's push part way")
        nodes.bed.link_down(1)  # node 1's cable is pulled
        for node in (0, 1):  # each daemon finishes its save locally, within a bound
            wait_for(lambda: (_request_of(nodes, node) or {}).get("phase") == "done", 60,
                     f"node {node}'s save to complete without its replica")
            replication = _request_of(nodes, node)["replication"]
            assert replication["reduced_redundancy"], replication
            (part,) = nodes.status(node)["redundancy"]
            assert part["iteration"] == 1 and part["reduced"] and part["reachable"] == 1
    finally:
        nodes.bed.link_up(1)  # the trainers' own collectives cross that link too
        runner.join(300)
    reports = values(result["outcomes"])
    for rank, (report,) in enumerate(reports):
        assert report["reduced_redundancy"] and report["copies"] == [addresses[rank]], report
        assert "no progress" in report["failed"][addresses[1 - rank]]
    for node in (0, 1):  # both parts are durable on their own node and committed
        assert os.path.exists(nodes.part(node, SESSION, 1, node))
    reports = values(nodes.run_ranks(save_iterations, placement,  # replicated again
                                     args=(roots, 1, 2, [2], SMALL), name="again"))
    assert all(not r["reduced_redundancy"] for (r,) in reports), reports
    wait_for(lambda: not nodes.status(0)["redundancy"][0]["reduced"], 60,
             "node 0 to report full redundancy again")


# Inside a node: dial another node's bulk listener with given keys; print what happened.
BULK_PROBE = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import peerclient
info, attempts = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(json.dumps([peerclient.bulk_refused(info, public, secret) for public, secret in attempts]))
"""


def test_an_unknown_key_can_neither_push_nor_fetch_on_the_bulk_path(bed_nodes):
    nodes = bed_nodes(2, require_netns=True)  # test_replication covers it on one host
    root = nodes.root(0)
    info = peerclient.register_session(nodes.socket(0), SESSION, root)
    stranger = peerclient.keypair()
    attempts = [stranger, (info["public_key"], stranger[1])]  # a stranger; an impostor
    probe = nodes.bed.run(1, [sys.executable, "-c", BULK_PROBE, TESTS_DIR, json.dumps(info),
                              json.dumps(attempts)], env={"PYTHONPATH": ROOT})
    refused = json.loads(probe.stdout)
    assert "closed after 0" in refused[0], refused  # not a byte of answer to a stranger
    assert refused[1] is not None, "an impostor without the secret key must be refused"
    wait_for(lambda: nodes.log(0).count("refused a bulk connection") >= 2, 30,
             "node 0 to log both refusals")
    assert not os.path.exists(os.path.join(root, SESSION, "iter_0000009"))
    # the trainers' table names the key now: the same probe is answered
    peerclient.register_session(nodes.socket(0), SESSION, root,
                                [["tcp://10.0.0.1:1", stranger[0], "10.0.0.1:1"]])
    probe = nodes.bed.run(1, [sys.executable, "-c", BULK_PROBE, TESTS_DIR, json.dumps(info),
                              json.dumps([stranger])], env={"PYTHONPATH": ROOT})
    assert json.loads(probe.stdout) == [None]


def test_a_restarted_trainer_loads_from_daemon_memory_and_from_disk_after_a_daemon_restart(
        bed_nodes):
    nodes = bed_nodes(2)
    placement = [0, 1]
    roots = roots_of(nodes, placement)
    values(nodes.run_ranks(save_iterations, placement, args=(roots, 1, 2, [1, 2], SMALL),
                           name="train"))
    for node in (0, 1):  # only the latest committed part stays in memory
        assert nodes.status(node)["memory_tier"]["parts"] == 1
    first = values(nodes.run_ranks(load_latest, placement, args=(roots, 1, 2, SMALL),
                                   name="restarted"))
    assert [(latest, report["source"]) for latest, _, report in first] == \
        [(2, "daemon_memory"), (2, "daemon_memory")]
    nodes.restart(0)  # node 0's daemon restarts (its disk is kept): its memory is gone
    second = values(nodes.run_ranks(load_latest, placement, args=(roots, 1, 2, SMALL),
                                    name="after-daemon-restart"))
    assert [(latest, report["source"]) for latest, _, report in second] == \
        [(2, "local_disk"), (2, "daemon_memory")]
