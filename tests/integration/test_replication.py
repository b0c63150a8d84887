"""Replication faults between daemons: a peer dying mid-stream, corrupted replicas, and
peers with keys the trainers never handed out. Real daemons on 127.0.0.x, real ranks,
faults injected by real means (SIGSTOP/SIGKILL, flipping bytes on disk, a zmq client).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from conftest import free_port, wait_for
from multirank import collect, run_ranks, start_ranks, values
from test_local_checkpoints import (BIG, PEER_ENV, SESSION, SHORT_PEER_ENV,  # noqa: F401
                                    find_and_load, make_nodes, same, state_of)

import peerclient
from peerclient import register_session

from ckpt_client.transport.daemon_save import wait_until_finished
from ckptd import protocol
from ckptd.replication.bulk_wire import Abort, Ready, send_control
from ckptd.replication.wire import PartGet, PartRefused, PeerPing, PeerPong


def flip_byte(path: str) -> None:
    """Corrupt one byte in the tensor area of a part file, as a failing disk would."""
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


def wait_for_file(path: str, timeout: float = 300.0) -> None:
    """Rank-side: block until the test created ``path`` (a handshake, not a delay)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


# ---------------------------------------------------------------- rank functions

def save_while_peer_dies(rank, world_size, roots, flags):
    """Rank 1 saves first (its replica reaches node 0); then the test freezes node 1 and
    rank 0 saves, so rank 0's push to node 1 is in flight when node 1 is killed."""
    from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    assert manager.find_latest() == -1  # registers the session (the key exchange)
    state = BasicTensorAwareStateDict(state_of(rank, 3, **BIG))
    if rank == 1:
        request = manager.save(state, 3, is_async=True)
        while not request.daemon_saves[0].finished:  # polls the daemon
            time.sleep(0.01)
        open(flags["rank1_done"], "w").close()
    else:
        wait_for_file(flags["go"])
        request = manager.save(state, 3, is_async=True)
        open(flags["rank0_staged"], "w").close()
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True)
    return manager.last_save_report


def push_while_peer_restarts(rank, world_size, roots, flags):
    """Both ranks register (the key exchange); on "go" rank 0 saves iteration 3 (its push
    to node 1 is in flight when the test kills and restarts node 1), and once node 1 is
    back, iteration 4 (pushed to the daemon the key table still names); rank 1 waits."""
    from ckpt_client import (BasicTensorAwareStateDict, CliqueReplicationStrategy,
                             LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    assert manager.find_latest() == -1  # registers the session (the key exchange)
    if rank == 1:
        wait_for_file(flags["done"])
        return None
    replications = []
    for iteration, flag in ((3, "go"), (4, "restarted")):
        wait_for_file(flags[flag])
        request = manager.save(BasicTensorAwareStateDict(state_of(rank, iteration, **BIG)),
                               iteration, is_async=True)
        save = request.daemon_saves[0]
        wait_until_finished([save])  # bounded: a dead daemon reads as failed
        assert save.error is None, save.error
        replications.append(save.last.replication)
        open(flags[f"saved{iteration}"], "w").close()
    open(flags["done"], "w").close()
    return replications


def load_with_corrupted_replica(rank, world_size, roots, corrupt, jump, factor, size=None):
    """find_latest, then rank 0 flips a byte in a replica before everybody loads."""
    import torch.distributed as dist

    from ckpt_client import (CliqueReplicationStrategy, DaemonRequestError,
                             LocalCheckpointManager)
    from ckptd.checksum import ChecksumMismatchError

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    latest = manager.find_latest()
    if rank == 0:
        flip_byte(corrupt)
    dist.barrier()
    try:
        loaded, _ = manager.load()
    except (DaemonRequestError, ChecksumMismatchError) as exc:
        error = str(exc)
    else:
        assert same(loaded.state_dict, state_of(rank, latest, **(size or {})))
        error = None
    again = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    return latest, error, manager.last_load_report, again.find_latest()


def save_once(rank, world_size, roots, jump, factor, iteration, size=None):
    from ckpt_client import (BasicTensorAwareStateDict, CliqueReplicationStrategy,
                             LocalCheckpointManager)

    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor)
    manager = LocalCheckpointManager(roots[rank], session_id=SESSION, repl_strategy=strategy)
    manager.save(BasicTensorAwareStateDict(state_of(rank, iteration, **(size or {}))), iteration)
    return manager.last_save_report


# ---------------------------------------------------------------- tests

def test_peer_killed_during_replication(make_nodes, tmp_path):
    # rank 0 on node 0, rank 1 on node 1; rank 0's push to the frozen node ends when it is
    # killed (nothing listens at its bulk address any more), or at the no-progress deadline
    # if that comes first (3 s while frozen)
    nodes = make_nodes(2, env=SHORT_PEER_ENV)
    flags = {name: str(tmp_path / name) for name in ("rank1_done", "go", "rank0_staged")}
    processes, results = start_ranks(save_while_peer_dies, 2, nodes.sockets(1), tmp_path,
                                     args=(nodes.roots(1), flags))
    wait_for(lambda: os.path.exists(flags["rank1_done"]), 300, "rank 1's save")
    peer = nodes.daemons[1]
    peer.process.send_signal(signal.SIGSTOP)  # frozen: rank 0's push cannot finish
    open(flags["go"], "w").close()

    def pushing_to_peer():
        streams = nodes.daemons[0].status()["replication"]["streams"]
        return any(s["kind"] == "push" and s["peer"] == nodes.addresses[1] for s in streams)

    wait_for(pushing_to_peer, 120, "rank 0's part streaming to node 1")
    peer.process.send_signal(signal.SIGKILL)
    reports = values(collect(processes, results, timeout=240))
    assert reports[0]["reduced_redundancy"] and reports[0]["replicated_to"] == []
    failed = reports[0]["failed"][nodes.addresses[1]]
    assert "nothing listens at" in failed or "no progress" in failed, failed
    assert reports[1] == {"iteration": 3, "replicated_to": [nodes.addresses[0]], "failed": {},
                          "reduced_redundancy": False, "wanted_copies": 2,
                          "copies": [nodes.addresses[1], nodes.addresses[0]]}
    assert reports[0]["copies"] == [nodes.addresses[0]] and reports[0]["wanted_copies"] == 2
    doc = nodes.daemons[0].status()
    mine = [r for r in doc["requests"] if r["rank"] == 0 and r["format"] == "local"]
    assert mine and mine[-1]["phase"] == "done"
    assert mine[-1]["replication"]["reduced_redundancy"]
    wait_for(lambda: nodes.daemons[0].status()["peers"][0]["health"] == "down", 30,
             "node 1 reported down")
    # load still works from what exists: node 1 comes back with its disk
    peer.process.wait()
    nodes.restart(1)
    sources = [report["source"] for latest, part_id, report in
               values(run_ranks(find_and_load, 2, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1), 1, 2, BIG), name="load"))
               if latest == 3]
    # node 0's daemon still holds rank 0's part in memory; node 1's restarted: its disk
    assert sources == ["daemon_memory", "local_disk"]


@pytest.mark.parametrize("bulk_port", ["any", "fixed"])
def test_a_push_to_a_peer_killed_and_restarted_mid_push_ends_at_once(make_nodes, tmp_path,
                                                                      bulk_port):
    """Rank 0's push to node 1 is in flight (node 1 frozen) when node 1 is killed -9 and
    started again: the new daemon does not know the transfer, nor the session, and has
    another key. The push fails once the dials keep meeting that (nothing listens at the
    bulk address any more, or, on a fixed bulk port, the new daemon, told of nobody yet,
    closes the handshake unanswered) for twice the handshake timeout (here 4 s), and the
    save is done with reduced redundancy while the no-progress deadline, 120 s, is far off
    (before, it waited all of it). The next save, pushed to the key the table still names,
    fails its push the same way. Both saves are durable locally."""
    env = {**PEER_ENV, "CKPTD_PEER_TIMEOUT": "120", "CKPTD_PEER_HANDSHAKE_TIMEOUT": "2"}
    if bulk_port == "fixed":  # every node on its own loopback address, the same port
        env["CKPTD_PEER_BULK_PORT"] = str(free_port())
    nodes = make_nodes(2, env=env)
    flags = {name: str(tmp_path / name)
             for name in ("go", "saved3", "restarted", "saved4", "done")}
    processes, results = start_ranks(push_while_peer_restarts, 2, nodes.sockets(1), tmp_path,
                                     args=(nodes.roots(1), flags))
    peer, address = nodes.daemons[1], nodes.addresses[1]

    def push_of(iteration: int) -> dict | None:
        doc = nodes.daemons[0].status()
        mine = [r for r in doc["requests"] if r["rank"] == 0 and r["format"] == "local"
                and r["path"].endswith(f"iter_{iteration:07d}/rank_0.part")]
        replication = (mine[-1].get("replication") or {}) if mine else {}
        return replication.get("holders", {}).get(address)

    wait_for(lambda: (nodes.daemons[0].status()["peers"] or [{}])[0].get("health") == "up", 60,
             "node 0 to hear node 1")
    peer.process.send_signal(signal.SIGSTOP)  # frozen: rank 0's push cannot finish
    open(flags["go"], "w").close()
    wait_for(lambda: (push_of(3) or {}).get("state") == "sending", 120,
             "rank 0's part streaming to node 1")
    nodes.restart(1)  # SIGKILL, then a new daemon: same addresses, new key, no session
    # Well within the push's 120 s deadline: ended by the peer's answers, not by waiting.
    ended = wait_for(lambda: (push_of(3) or {}).get("state") == "failed" and push_of(3), 90,
                     "rank 0's push to end once node 1 was restarted")
    gone = ("nothing listens at", "closed the handshake without an answer")
    assert "was lost" in ended["error"] and any(g in ended["error"] for g in gone), ended
    assert "no progress" not in ended["error"], ended
    wait_for(lambda: os.path.exists(flags["saved3"]), 60, "rank 0's save 3 to be done")
    open(flags["restarted"], "w").close()
    wait_for(lambda: os.path.exists(flags["done"]), 90, "rank 0's save 4 to be done")
    [third, fourth], none = values(collect(processes, results, timeout=120))
    assert none is None
    for replication in (third, fourth):
        assert replication["reduced_redundancy"], replication
        assert replication["holders"][address]["state"] == "failed", replication
    said = gone[1] if bulk_port == "fixed" else gone[0]
    assert said in fourth["holders"][address]["error"], fourth
    for iteration in (3, 4):
        assert os.path.exists(nodes.part(0, iteration, 0)), "rank 0's own part is durable"


def test_corrupted_replica_is_skipped_for_the_next_holder(make_nodes, tmp_path):
    nodes = make_nodes(3)  # 3 nodes x 1 rank, one clique (0, 1, 2)
    values(run_ranks(save_once, 3, nodes.sockets(1), tmp_path,
                     args=(nodes.roots(1), 1, 3, 4, BIG), name="save"))
    nodes.restart(0, wipe=True)
    corrupt = nodes.part(1, 4, 0)  # the first holder's replica of rank 0
    outcomes = values(run_ranks(load_with_corrupted_replica, 3, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1), corrupt, 1, 3, BIG), name="load"))
    latest, error, report, again = outcomes[0]
    assert latest == 4 and error is None
    assert (report["source"], report["holder"]) == ("peer", nodes.addresses[2])
    assert [t["holder"] for t in report["tried"]] == [nodes.addresses[1]]
    assert "corrupted" in report["tried"][0]["error"]
    assert again == 4  # node 0 now holds a verified copy again
    doc = nodes.daemons[1].status()
    bad = [p for p in doc["local_checkpoints"] if p["owner"] == 0]
    assert bad and bad[0]["verified"] is False


def test_only_replica_corrupted_gives_a_clear_error(make_nodes, tmp_path):
    nodes = make_nodes(2)
    values(run_ranks(save_once, 2, nodes.sockets(1), tmp_path,
                     args=(nodes.roots(1), 1, 2, 4), name="save"))
    nodes.restart(0, wipe=True)
    outcomes = values(run_ranks(load_with_corrupted_replica, 2, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1), nodes.part(1, 4, 0), 1, 2), name="load"))
    latest, error, _, again = outcomes[0]
    assert latest == 4
    assert "rank 0's part of iteration 4" in error and nodes.addresses[1] in error
    assert "corrupted" in error
    assert outcomes[1][1] is None  # rank 1's own part was fine
    assert again == -1 and outcomes[1][3] == -1  # no verified copy of rank 0's part is left
    assert not os.path.exists(nodes.part(0, 4, 0))  # the bad bytes were never stored


@pytest.fixture
def zmq_context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _client(context, address: str, server_key: str, keypair):
    sock = context.socket(zmq.DEALER)
    sock.linger = 0
    sock.curve_serverkey = server_key.encode()
    sock.curve_publickey, sock.curve_secretkey = keypair
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(address)
    return sock, monitor


def _handshake_event(monitor) -> int:
    from zmq.utils.monitor import recv_monitor_message

    assert monitor.poll(30_000), "no handshake outcome within 30s"
    return recv_monitor_message(monitor)["event"]


def test_unknown_key_cannot_push_or_fetch(make_nodes, tmp_path, zmq_context):
    nodes = make_nodes(1)
    root = nodes.roots(1)[0]
    info = register_session(nodes.daemons[0].socket, SESSION, root)
    stranger = peerclient.keypair()
    # the control socket: the CURVE handshake fails, a fetch request gets no answer
    sock, monitor = _client(zmq_context, info["address"], info["public_key"],
                            tuple(k.encode() for k in stranger))
    get = PartGet(xfer=2, session=SESSION, owner=5, iteration=9, requester="tcp://127.0.0.254:1")
    sock.send_multipart(protocol.encode(PartGet.message_type, 0, get.to_wire()))
    assert _handshake_event(monitor) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert not sock.poll(500), "an unknown key got an answer"
    assert "unknown CURVE key" in nodes.daemons[0].log()
    # the bulk path: refused before a byte of answer; nothing is written
    assert "closed after 0" in peerclient.bulk_refused(info, *stranger)
    # ... also when it claims the daemon's own (public) key without holding its secret
    assert peerclient.bulk_refused(info, info["public_key"], stranger[1]) is not None
    assert not os.path.exists(os.path.join(root, SESSION, "iter_0000009"))
    wait_for(lambda: nodes.daemons[0].log().count("refused a bulk connection") >= 2, 30,
             "the daemon to log both refused bulk connections")

    # the same key is served on both paths once the trainers' table names it
    register_session(nodes.daemons[0].socket, SESSION, root,
                     [["tcp://127.0.0.254:1", stranger[0], "127.0.0.254:1"]])
    sock2, monitor2 = _client(zmq_context, info["address"], info["public_key"],
                              tuple(k.encode() for k in stranger))
    sock2.send_multipart(protocol.encode(PeerPing.message_type, 0, PeerPing(1.0).to_wire()))
    assert _handshake_event(monitor2) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert sock2.poll(30_000), "a known key got no answer"
    assert protocol.decode(sock2.recv_multipart()).type == PeerPong.message_type
    channel = peerclient.dial_bulk(info, *stranger)
    try:
        assert peerclient.push_begin(channel, 1, SESSION, 5, 9, 4) == Ready(ok=True)
        send_control(channel, 1, Abort("test"))
    finally:
        channel.close()


def test_a_corrupted_own_part_is_set_aside_and_healed_from_a_verified_replica(make_nodes,
                                                                              tmp_path):
    # 2 nodes x 1 rank, one clique (0, 1): each holds the other's part; without the memory
    # tier, so that the loads read the disk
    nodes = make_nodes(2, env={**PEER_ENV, "CKPTD_MEMORY_TIER": "0"})
    values(run_ranks(save_once, 2, nodes.sockets(1), tmp_path,
                     args=(nodes.roots(1), 1, 2, 6), name="save"))
    own = nodes.part(0, 6, 0)  # rank 0's own part on its own node; node 1 holds a replica
    outcomes = values(run_ranks(load_with_corrupted_replica, 2, nodes.sockets(1), tmp_path,
                                args=(nodes.roots(1), own, 1, 2), name="load"))
    latest, error, report, again = outcomes[0]
    assert latest == 6 and error is None, error  # the data loaded equals what was saved
    assert (report["source"], report["holder"]) == ("peer", nodes.addresses[1])
    aside = report["moved_aside"]
    assert aside and os.path.basename(aside).startswith("rank_0.part.corrupt-")
    assert os.path.exists(aside), "the corrupted part is kept for inspection, not deleted"
    assert "moved aside" in nodes.daemons[0].log() and aside in nodes.daemons[0].log()
    assert again == 6 and outcomes[1][2]["source"] == "local_disk"
    run = subprocess.run([sys.executable, "-m", "ckptd", "verify", os.path.dirname(own)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr  # the healed iteration verifies


def _ask(sock, body) -> None:
    sock.send_multipart(protocol.encode(body.message_type, 0, body.to_wire()))


def test_a_keyed_peer_cannot_make_a_holder_push_a_part_onto_another_daemon(make_nodes,
                                                                           tmp_path,
                                                                           zmq_context):
    nodes = make_nodes(2)  # rank 0 on node 0, rank 1 on node 1: each holds both parts
    values(run_ranks(save_once, 2, nodes.sockets(1), tmp_path,
                     args=(nodes.roots(1), 1, 2, 5), name="save"))
    holder, victim = nodes.daemons[0], nodes.daemons[1]
    # an intruder whose key the trainers of another session did name on the holder
    intruder = peerclient.keypair()
    intruder_address = "tcp://127.0.0.254:1"
    info = register_session(holder.socket, "other-job", nodes.roots(1)[0] + "-other",
                            [[intruder_address, intruder[0], "127.0.0.254:1"]])
    sock, monitor = _client(zmq_context, info["address"], info["public_key"],
                            tuple(k.encode() for k in intruder))
    received_before = victim.log().count("receiving ")
    # it asks for rank 0's part of iteration 5 to go to node 1's daemon
    _ask(sock, PartGet(xfer=7, session=SESSION, owner=0, iteration=5,
                       requester=nodes.addresses[1]))
    assert _handshake_event(monitor) == zmq.EVENT_HANDSHAKE_SUCCEEDED  # real CURVE, admitted
    assert sock.poll(30_000), "the holder did not answer the request"
    answer = protocol.decode(sock.recv_multipart())
    assert answer.type == PartRefused.message_type
    refusal = PartRefused.from_wire(answer.body)
    assert refusal.xfer == 7 and nodes.addresses[1] in refusal.error
    assert "only to the daemon that asks" in refusal.error
    assert f"to {intruder_address}: {intruder_address} asked for a copy to go to " \
           f"{nodes.addresses[1]}" in holder.log()
    assert "outgoing: serving " not in holder.log()
    assert not [s for s in holder.status()["replication"]["streams"] if s["kind"] == "serve"]
    # the same request naming no one is served to the intruder itself (its own table
    # entry, where nothing listens), never to the victim
    _ask(sock, PartGet(xfer=8, session=SESSION, owner=0, iteration=5))
    wait_for(lambda: any("outgoing: serving " in line and line.endswith(f"to {intruder_address}")
                         for line in holder.log().splitlines()),
             30, "the holder to serve the intruder's own address")
    assert victim.log().count("receiving ") == received_before
