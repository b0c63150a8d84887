"""A peer's link goes down while a local checkpoint replicates to it (``ip link set down``).

Two nodes of a network-namespace bed (tests/netbed.py: each node its own namespace, veth
link and tmpfs), a daemon per node, a rank per node, replication factor 2: each rank's
part streams to the other node. Node 1's cable is pulled at the bridge once node 0's push
has moved part of its bytes. What must hold:

- while the push stands still, ``ckptd status`` on node 0 flags the save stuck (and did
  not while bytes moved: the flag tells a cut link from a slow one);
- the replication deadline (``CKPTD_PEER_TIMEOUT``, no progress) ends each push, and every
  rank's save report names the peer and the phase; the save itself completes locally with
  reduced redundancy (a lost replica is not a lost checkpoint);
- nothing partial is committed as a replica: node 1 keeps no file of rank 0's part, not
  even after the link is back and the receiver had its chance to finish late;
- once the link is up (always restored, even when an assertion fails) the next save is
  replicated in full again.

The bed and every process in it are torn down by the ``netbed`` fixture whatever happens.
"""

from __future__ import annotations

import glob
import os
import threading
import time

from conftest import wait_for
from conftest_netbed import netbed  # noqa: F401  (the fixture bed_nodes uses)
from test_local_checkpoints import SESSION
from test_local_netbed import (SMALL, _request_of, bed_nodes, roots_of,  # noqa: F401
                               save_iterations)

from bednodes import values

#: 30 Mbit/s: a 32 MiB part takes ~9 s to cross, in 4 MiB chunks acknowledged every
#: ~1.1 s, so a save moving bytes is seldom 3 s without progress (on a loaded machine
#: acknowledgements come unevenly); a cut link is, and after 6 s without progress the
#: push fails. One bulk connection per peer: over four, four chunks share the link and
#: are acknowledged together every ~4.5 s, and a push can then look stalled between
#: bursts for as long as the stuck threshold.
STUCK_AFTER = 3.0
LINK_DOWN_ENV = {"CKPTD_PEER_TIMEOUT": "6", "CKPTD_STUCK_AFTER": str(STUCK_AFTER),
                 "CKPTD_PEER_STREAMS": "1"}


def pushing(nodes) -> bool:
    streams = nodes.status(0)["replication"]["streams"]
    return any(s["direction"] == "out" and 0 < s["bytes_done"] < s["size"] for s in streams)


def local_save(nodes) -> dict | None:
    saves = [s for s in nodes.status(0)["saves"] if s["format"] == "local"]
    return saves[0] if saves else None


def test_a_peer_link_cut_during_replication_is_named_and_nothing_partial_is_kept(bed_nodes):
    nodes = bed_nodes(2, rate="30mbit", require_netns=True, env=LINK_DOWN_ENV)
    placement = [0, 1]
    roots = roots_of(nodes, placement)
    addresses = [nodes.address(0), nodes.address(1)]
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(outcomes=nodes.run_ranks(
        save_iterations, placement, args=(roots, 1, 2, [1], {"big_mib": 32}), timeout=240,
        name="save")))
    runner.start()
    try:
        wait_for(lambda: pushing(nodes), 120, "node 0's push to start")
        started = time.monotonic()
        # Past the stuck threshold into the push, a save whose chunks keep arriving is
        # not stuck (without counting them it would be: its last write is older).
        wait_for(lambda: time.monotonic() - started > STUCK_AFTER + 0.5 and pushing(nodes)
                 and not (local_save(nodes) or {"stuck": True})["stuck"], 30,
                 "a moment, while the push moves, when the save is not flagged stuck")
        nodes.bed.link_down(1)  # node 1's cable is pulled
        stuck = wait_for(lambda: (local_save(nodes) or {}).get("stuck") and local_save(nodes),
                         30, "status on node 0 to flag the save stuck while its push stands")
        assert stuck["iteration"] == 1 and stuck["phases"] == {"0": "replicating"}, stuck
        for node in (0, 1):  # the deadline ends the push; the save completes locally
            wait_for(lambda: (_request_of(nodes, node) or {}).get("phase") == "done", 60,
                     f"node {node}'s save to complete without its replica")
    finally:
        nodes.bed.link_up(1)  # the trainers' own collectives cross that link too
        runner.join(300)
    reports = values(result["outcomes"])
    for rank, (report,) in enumerate(reports):
        peer = addresses[1 - rank]
        assert report["reduced_redundancy"] and report["copies"] == [addresses[rank]], report
        reason = report["failed"][peer]
        assert reason.startswith(f"phase 'replicating': rank {rank}'s part of iteration 1 to "
                                 f"{peer} made no progress for 6s"), reason
    # Node 1 heard nothing more of rank 0's push (node 0 ended it): no replica, no partial
    # file, once node 1 has no stream of it left.
    wait_for(lambda: not [s for s in nodes.status(1)["replication"]["streams"]
                          if s["direction"] == "in"], 60, "node 1 to drop the cut stream")
    for node, owner in ((1, 0), (0, 1)):
        replica = nodes.part(node, SESSION, 1, owner)
        assert not glob.glob(replica + "*"), \
            f"node {node} kept (part of) rank {owner}'s replica: {glob.glob(replica + '*')}"
        assert os.path.exists(nodes.part(node, SESSION, 1, node)), "its own part is durable"
    reports = values(nodes.run_ranks(save_iterations, placement,  # replicated again
                                     args=(roots, 1, 2, [2], SMALL), name="again"))
    assert all(not r["reduced_redundancy"] for (r,) in reports), reports
    for node, owner in ((1, 0), (0, 1)):
        assert os.path.exists(nodes.part(node, SESSION, 2, owner))
