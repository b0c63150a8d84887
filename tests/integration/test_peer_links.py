"""Which peer daemons a daemon keeps links to: its clique mates, not the whole job.

Real daemons on 127.0.0.x and real gloo ranks (``test_local_checkpoints``' nodes). A
daemon dials and heartbeats the daemons it replicates with; a daemon outside its clique
(a holder after a re-shaped restart) is dialed when a fetch needs it and the link is
closed once unused for ``CKPTD_PEER_IDLE_TIMEOUT``. ``CKPTD_PEER_LINKS=all`` keeps the
former all-to-all mesh. Each daemon's links are read from its status document.
"""

from __future__ import annotations

import pytest

from conftest import wait_for
from multirank import run_ranks, values
from test_local_checkpoints import (PEER_ENV, find_and_load, make_nodes,  # noqa: F401
                                    save_find_load)
from test_replication import save_once

#: An on-demand link unused for 2 s is closed (the default is much longer).
LINK_ENV = {**PEER_ENV, "CKPTD_PEER_IDLE_TIMEOUT": "2"}


def linked(nodes, node: int) -> set[str]:
    """The peers node ``node``'s daemon has a link to now."""
    return {peer["address"] for peer in nodes.daemons[node].status()["peers"]}


def up_links(nodes, node: int) -> set[str] | None:
    """The peers node ``node``'s daemon has a link to now, or None while one is not up."""
    peers = nodes.daemons[node].status()["peers"]
    return None if any(p["health"] != "up" for p in peers) else {p["address"] for p in peers}


@pytest.mark.parametrize("mode", ["clique", "all"])
def test_a_daemon_links_to_its_clique_mates_only_unless_the_mesh_is_asked_for(make_nodes,
                                                                              tmp_path, mode):
    nodes = make_nodes(4, env={**LINK_ENV, "CKPTD_PEER_LINKS": mode})
    # factor 2, jump 1, a rank per node: cliques (0, 1) and (2, 3)
    # find_latest, save, find_latest and load: the daemons dial their peers at find_latest
    outcomes = values(run_ranks(save_find_load, 4, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1), 1, 2, [1], False), name="save"))
    assert all(not reports[-1]["reduced_redundancy"] for _, _, reports, _ in outcomes)
    a = nodes.addresses
    expected = ({0: {a[1]}, 1: {a[0]}, 2: {a[3]}, 3: {a[2]}} if mode == "clique" else
                {n: set(a) - {a[n]} for n in range(4)})
    for node in range(4):
        # a link dialed a moment ago is listed before its first heartbeat says it is up
        wait_for(lambda: up_links(nodes, node) == expected[node], 30,
                 f"node {node}'s links to be {sorted(expected[node])}, every one up")


def test_a_holder_outside_the_clique_is_dialed_for_a_fetch_and_dropped_when_idle(make_nodes,
                                                                                  tmp_path):
    nodes = make_nodes(4, env=LINK_ENV)
    values(run_ranks(save_once, 4, nodes.sockets(1), tmp_path,
                     args=(nodes.roots(1), 1, 2, 3), name="save"))
    a = nodes.addresses
    # Re-shaped restart: the pairs of nodes swap their ranks. Rank 0 now runs on node 2,
    # whose clique mate is node 3 (rank 1): neither holds rank 0's part, nodes 0 and 1 do.
    placement = [2, 3, 0, 1]
    sockets = [nodes.daemons[n].socket for n in placement]
    roots = [nodes.roots(1)[n] for n in placement]
    loaded = values(run_ranks(find_and_load, 4, sockets, tmp_path, args=(roots, 1, 2),
                              name="reshaped"))
    assert [latest for latest, _, _ in loaded] == [3, 3, 3, 3]
    rank0 = loaded[0][2]
    assert (rank0["source"], rank0["holder"]) == ("peer", a[0]), rank0  # the far holder
    assert f"fetching rank 0's part of iteration 3 from {a[0]}" in nodes.daemons[2].log()
    # node 2 keeps its clique mate and lets the far holder go
    # (the on-demand link may not be listed yet when the load returns: wait on its close)
    wait_for(lambda: f"closed the idle on-demand link to {a[0]}" in nodes.daemons[2].log(), 60,
             "node 2 to close its idle link to node 0")
    # status shows the replicator's last snapshot of its links: wait for one taken after it
    wait_for(lambda: linked(nodes, 2) == {a[3]}, 30,
             "node 2's status to list its clique mate node 3 alone (it must keep that link)")
    # the holder closes the bulk connections it served the copy on
    wait_for(lambda: f"closed the idle bulk connections to {a[2]}" in nodes.daemons[0].log(),
             60, "node 0 to close its idle bulk connections to node 2")
    wait_for(lambda: linked(nodes, 0) == {a[1]}, 30,
             "node 0's status to list its clique mate node 1 alone")
