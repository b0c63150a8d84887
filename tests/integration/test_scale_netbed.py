"""Many nodes: 8, 16 and 32 network-namespace nodes save, lose one, restore.

Each node is a namespace with its own tmpfs and a ``tc``-limited link (``tests/netbed.py``),
one real ``ckptd serve`` and one small rank (a few more where the replication factor needs
a multiple: ``tests/scalebed.py``), gloo over the node's veth. Every rank saves; node 1's
daemon is SIGKILLed and its tmpfs wiped, the daemon started again; every rank loads and
checks its data bit for bit: node 1's ranks get their part from a clique mate, the
others from their daemon's memory. Each daemon keeps links to its clique mates only.

The 8-node case with factor 2 runs in the default suite; the other factors, jumps and
sizes are ``slow`` (16 and 32 nodes need most of the machine: run them alone).
"""

from __future__ import annotations

import pytest

from bednodes import BedNodes, values
from conftest import wait_for
from conftest_netbed import netbed  # noqa: F401  (the fixture)
from scalebed import SMALL, clique_nodes, layout, load_timed, save_timed

#: Small daemons: a 32 MiB pool and one writer each (parts are about 1 MiB).
SCALE_DAEMON = {"pool_size": "32M", "writers": 1}
SCALE_ENV = {"CKPTD_PEER_TIMEOUT": "30", "CKPTD_PEER_PING_INTERVAL": "1"}
LOST = 1


def _case(nodes: int, factor: int, jump: int, slow: bool = True):
    return pytest.param(nodes, factor, jump, id=f"{nodes}nodes-factor{factor}-jump{jump}",
                        marks=[pytest.mark.slow] if slow else [])


CASES = [_case(8, 2, 2, slow=False)] + [
    _case(nodes, factor, jump) for nodes in (8, 16, 32) for factor in (2, 3)
    for jump in (1, 2) if (nodes, factor, jump) != (8, 2, 2)]


@pytest.mark.parametrize("count,factor,jump", CASES)
def test_many_nodes_save_lose_one_and_restore_bit_identical(netbed, tmp_path,  # noqa: F811
                                                           count, factor, jump):
    bed = netbed(count, rate="1gbit", tmpfs_size="128m", require_netns=True)
    nodes = BedNodes(bed, str(tmp_path), env=SCALE_ENV, **SCALE_DAEMON)
    try:
        placement = layout(count, factor, jump)
        roots = [nodes.root(node) for node in placement]
        addresses = [nodes.address(i) for i in range(count)]
        saved = values(nodes.run_ranks(save_timed, placement,
                                       args=(roots, jump, factor, 1, SMALL), name="save",
                                       timeout=600))
        mates = clique_nodes(placement, factor, jump)
        for rank, outcome in enumerate(saved):
            report = outcome["report"]
            assert not report["reduced_redundancy"], report
            assert len(set(report["copies"])) == factor == report["wanted_copies"], report
            assert report["copies"][0] == addresses[placement[rank]]
            assert set(report["copies"][1:]) <= {addresses[m] for m in mates[placement[rank]]}
        for node in range(count):  # links to the clique mates, no one else
            want = {addresses[m] for m in mates[node]}
            wait_for(lambda: {p["address"] for p in nodes.status(node)["peers"]} == want, 60,
                     f"node {node}'s links to be its clique mates {sorted(want)}")
        nodes.restart(LOST, wipe=True)
        loaded = values(nodes.run_ranks(load_timed, placement,
                                        args=(roots, jump, factor, SMALL), name="load",
                                        timeout=600))
        for rank, outcome in enumerate(loaded):
            assert outcome["latest"] == 1 and outcome["part_id"][:2] == (1, rank)
            report = outcome["report"]
            if placement[rank] == LOST:
                assert report["source"] == "peer", report
                assert report["holder"] in {addresses[m] for m in mates[LOST]}, report
            else:  # their daemons lived on and kept the part in memory
                assert report["source"] == "daemon_memory", report
    finally:
        nodes.stop_all()
