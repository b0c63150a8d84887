"""Local checkpoints inside the serve loop: sessions, the replication step of a save, load.

Owns the daemon's half of ``ckpt_client.LocalCheckpointManager``:

- ``PEER_INFO`` / ``LOCAL_SESSION``: the key exchange. Each rank asks its daemon for its
  peer address and CURVE public key, the trainers all-gather them over their own process
  group, and every rank hands its daemon the whole table (rank -> address, key) and the
  replication cliques. Only keys in those tables may connect to the peer socket.
- the replication step of a ``local`` save: after staging, :meth:`start_replication`
  has the replicator stream the extent to the daemons of the owner's clique mates while
  the writers write the local part; the request settles (and its extent is released)
  only when both are done. A failed or timed-out peer makes the save *reduced
  redundancy*, reported in the poll result and in status, never a hang.
- ``LOCAL_INVENTORY`` (parts held, verified), ``LOCAL_FETCH`` (a missing part from the
  holders, in the order given, deferred until the replicator answers) and
  ``LOCAL_COMMIT`` (all ranks agreed: mark committed, drop older iterations).

Pattern: handlers for the serve loop's one dispatch table (a reply body, or
``DEFERRED``); events from the replicator thread arrive through :meth:`drain`. Files are
``ckptd.local_store``'s business, the network ``ckptd.replication``'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ckptd import protocol
from ckptd.ledger import SaveRequest, host_name
from ckptd.local_store import LocalSession, LocalStore, LocalStoreError
from ckptd.protocol import ErrorCode, MessageType, Phase, SaveFormat
from ckptd.replication import (CMD_CANCEL, CMD_CONNECT, CMD_FETCH, CMD_PEERS, CMD_PUSH,
                               EVT_FETCH_DONE, EVT_PUSH_DONE, Replicator)
from ckptd.roots import AllowedRoots

log = logging.getLogger(__name__)


@dataclass
class SessionPeers:
    """What the trainers told this daemon about one session's daemons and cliques."""

    peers: list  # per rank: [address, public key] or None
    cliques: list = field(default_factory=list)

    def key_of(self, address: str) -> str | None:
        """The public key the trainers gave for the daemon at ``address``."""
        return next((entry[1] for entry in self.peers if entry and entry[0] == address), None)

    def clique_of(self, rank: int) -> list:
        """The clique ``rank`` belongs to (``[rank]`` without replication)."""
        return next((list(c) for c in self.cliques if rank in c), [rank])


class LocalCheckpoints:
    """The daemon's local-checkpoint service (see the module docstring).

    Parameters
    ----------
    daemon : ckptd.server.Daemon
        The serve loop this service belongs to (for replies, settling and the pool).
    """

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.store: LocalStore | None = None
        self.replicator: Replicator | None = None
        self.sessions: dict[str, SessionPeers] = {}
        self._pushing: dict[int, SaveRequest] = {}
        self._fetches: dict[int, dict] = {}
        self._next_fetch = 1

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Open the store; bind the peer socket when ``--peer-listen`` was given."""
        config = self.daemon.config
        if config.local_dir:
            os.makedirs(config.local_dir, exist_ok=True)
            allowed = AllowedRoots.of([config.local_dir])
        else:
            allowed = self.daemon.roots
        self.store = LocalStore(allowed)
        if config.peer_listen:
            self.replicator = Replicator(config.peer_listen, self.store, self.daemon.pool.path,
                                         self.daemon.pool.size)
            self.replicator.start()

    @property
    def wake_socket(self):
        """The socket the serve loop polls for replicator events (``None`` without peers)."""
        return self.replicator.wake_socket if self.replicator is not None else None

    @property
    def address(self) -> str | None:
        """This daemon's peer address (``None`` without ``--peer-listen``)."""
        return self.replicator.address if self.replicator is not None else None

    def drain(self) -> None:
        """Handle the replicator's pending events."""
        self.replicator.drain(self._on_event)

    def stop(self) -> None:
        """Stop replicating (streams in flight are dropped; peers time them out)."""
        if self.replicator is not None:
            self.replicator.stop()
            self.replicator = None

    # ------------------------------------------------------------------ handlers
    def _error(self, code: str, message: str, hint: str = ""):
        from ckptd.server import RequestError

        return RequestError(code, message, hint)

    def _session(self, body: dict) -> LocalSession:
        try:
            return self.store.session(body.get("session"))
        except LocalStoreError as exc:
            raise self._error(ErrorCode.NOT_CONFIGURED, str(exc)) from None

    def on_peer_info(self, identity: bytes, msg: protocol.Message) -> dict:
        """This daemon's peer address and CURVE public key (``None`` without peers)."""
        return {"address": self.address,
                "public_key": self.replicator.public_key if self.replicator else None,
                "local_dir": self.daemon.config.local_dir, "host": host_name(),
                "pid": os.getpid()}

    def on_local_session(self, identity: bytes, msg: protocol.Message) -> dict:
        """Register a session's root, its peer table and cliques."""
        rank = self.daemon._rank_of(identity)
        body = msg.body
        peers, cliques = body.get("peers", []), body.get("cliques", [])
        if not isinstance(peers, list) or not all(
                p is None or (isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p))
                for p in peers):
            raise self._error(ErrorCode.BAD_REQUEST, "'peers' must list [address, key] per rank")
        if not isinstance(cliques, list) or not all(
                isinstance(c, list) and all(isinstance(r, int) for r in c) for c in cliques):
            raise self._error(ErrorCode.BAD_REQUEST, "'cliques' must be lists of ranks")
        if any(len(c) > 1 for c in cliques) and self.replicator is None:
            raise self._error(ErrorCode.NOT_CONFIGURED,
                              f"rank {rank.rank}: replication needs peer daemons, but this "
                              "ckptd has no peer socket",
                              "start ckptd with --peer-listen tcp://<node address>:<port>")
        try:
            session = self.store.register(body.get("session", ""), body.get("root"))
        except LocalStoreError as exc:
            raise self._error(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        self.sessions[session.session_id] = SessionPeers(peers, cliques)
        if self.replicator is not None:
            every = [p for sp in self.sessions.values() for p in sp.peers if p]
            self.replicator.command(CMD_PEERS, {
                "peers": sorted({tuple(p) for p in peers if p}),
                "allowed": sorted({p[1] for p in every})})
        return {"directory": session.directory, "address": self.address}

    def on_local_inventory(self, identity: bytes, msg: protocol.Message) -> dict:
        """The parts this node holds for a session, each verified against its checksum."""
        session = self._session(msg.body)
        if self.replicator is not None:  # every daemon has the key table by now: dial peers
            self.replicator.command(CMD_CONNECT, {})
        parts = self.store.inventory(session, verify=True)
        return {"address": self.address, "host": host_name(),
                "parts": [{k: p[k] for k in ("iteration", "owner", "size", "verified", "committed",
                                             "path")} for p in parts]}

    def on_local_commit(self, identity: bytes, msg: protocol.Message) -> dict:
        """Every rank's save of an iteration is durable: mark it, drop older iterations."""
        rank = self.daemon._rank_of(identity)
        session = self._session(msg.body)
        iteration = _iteration(msg.body, self._error)
        removed = self.store.commit(session, iteration)
        log.info("rank %d committed iteration %d of session %r", rank.rank, iteration,
                 session.session_id)
        return {"removed": removed}

    def on_local_fetch(self, identity: bytes, msg: protocol.Message):
        """Fetch a part this node lacks from the holders, in the order the client gave."""
        from ckptd.server import DEFERRED

        rank = self.daemon._rank_of(identity)
        session = self._session(msg.body)
        iteration = _iteration(msg.body, self._error)
        owner, holders = msg.body.get("owner"), msg.body.get("holders", [])
        if not isinstance(owner, int) or not isinstance(holders, list):
            raise self._error(ErrorCode.BAD_REQUEST, "fetch needs 'owner' (int) and 'holders' (list)")
        if self.replicator is None:
            raise self._error(ErrorCode.NOT_CONFIGURED,
                              f"rank {rank.rank}: cannot fetch rank {owner}'s part of iteration "
                              f"{iteration}: this ckptd has no peer socket",
                              "start ckptd with --peer-listen")
        peers = self.sessions.get(session.session_id) or SessionPeers([])
        keyed = [[address, peers.key_of(address)] for address in holders
                 if isinstance(address, str) and peers.key_of(address)]
        fetch_id, self._next_fetch = self._next_fetch, self._next_fetch + 1
        self._fetches[fetch_id] = {"identity": identity, "msg_id": msg.id, "rank": rank.rank,
                                   "owner": owner, "iteration": iteration, "holders": holders,
                                   "session": session.session_id}
        log.info("rank %d: fetching rank %d's part of iteration %d from %s", rank.rank, owner,
                 iteration, ", ".join(holders) or "(no holder)")
        self.replicator.command(CMD_FETCH, {
            "fetch_id": fetch_id, "session": session.session_id, "owner": owner,
            "iteration": iteration, "path": session.part_path(iteration, owner),
            "holders": keyed})
        return DEFERRED

    # ------------------------------------------------------------------ saves
    def part_path_for(self, rank: int, body: dict) -> tuple[str, dict]:
        """Destination of a ``local`` save, and the request's local-checkpoint fields."""
        session = self._session(body)
        iteration = _iteration(body, self._error)
        self.store.begin_iteration(session, iteration)
        return session.part_path(iteration, rank), {"session": session.session_id,
                                                    "iteration": iteration}

    def holders_for(self, session_id: str, owner: int) -> tuple[list, int]:
        """Daemons that keep ``owner``'s replicas (clique order after the owner), and how
        many replicas the clique asks for."""
        peers = self.sessions.get(session_id)
        if peers is None or self.replicator is None:
            return [], 0
        clique = peers.clique_of(owner)
        at = clique.index(owner)
        seen, holders = {self.address}, []
        for mate in clique[at + 1:] + clique[:at]:
            entry = peers.peers[mate] if 0 <= mate < len(peers.peers) else None
            if entry and entry[0] not in seen:
                seen.add(entry[0])
                holders.append(list(entry))
        return holders, len(clique) - 1

    def start_replication(self, request: SaveRequest) -> None:
        """Start streaming a staged ``local`` part to its holders (no-op for other saves)."""
        if request.format != SaveFormat.LOCAL or request.local is None:
            return
        holders, wanted = self.holders_for(request.local["session"], request.rank)
        request.replication = {
            "wanted": wanted, "reduced_redundancy": len(holders) < wanted,
            "holders": {address: {"state": "sending", "error": None, "bytes": 0}
                        for address, _ in holders}}
        if wanted and len(holders) < wanted:
            log.warning("request %d (rank %d): only %d of %d clique mates live on other nodes; "
                        "choose replication_jump = ranks per node", request.id, request.rank,
                        len(holders), wanted)
        if not holders:
            return
        base = request.extent.offset
        self._pushing[request.id] = request
        self.replicator.command(CMD_PUSH, {
            "request_id": request.id, "owner": request.rank, "session": request.local["session"],
            "iteration": request.local["iteration"], "holders": holders,
            "items": [[base + offset, buffer[2]]
                      for offset, buffer in zip(request.offsets, request.buffers)]})

    def _replicating(self, request: SaveRequest) -> bool:
        return request.id in self._pushing

    def holds_back_settle(self, request: SaveRequest) -> bool:
        """Whether ``request`` must wait for its replicas before it settles."""
        if not self._replicating(request):
            return False
        if request.phase == Phase.WRITING:
            request.phase = Phase.REPLICATING
            log.info("request %d (rank %d) written locally; replicating to %s", request.id,
                     request.rank, ", ".join(request.replication["holders"]))
        return True

    def cancel_replication(self, request: SaveRequest) -> bool:
        """Stop a save's pushes; ``True`` if some were running (they answer later)."""
        if not self._replicating(request):
            return False
        self.replicator.command(CMD_CANCEL, {"request_id": request.id})
        return True

    # ------------------------------------------------------------------ events
    def _on_event(self, kind: str, body: dict) -> None:
        if kind == EVT_PUSH_DONE:
            self._on_push_done(body)
        elif kind == EVT_FETCH_DONE:
            self._on_fetch_done(body)

    def _on_push_done(self, body: dict) -> None:
        request = self._pushing.get(body["request_id"])
        if request is None:
            return
        holder = request.replication["holders"].get(body["holder"])
        if holder is not None:
            holder.update(state="done" if body["ok"] else "failed", error=body["error"],
                          bytes=body["bytes"])
        if any(h["state"] == "sending" for h in request.replication["holders"].values()):
            return
        del self._pushing[request.id]
        failed = {a: h["error"] for a, h in request.replication["holders"].items()
                  if h["state"] == "failed"}
        if failed:
            request.replication["reduced_redundancy"] = True
            log.warning("request %d (rank %d) has reduced redundancy: %s", request.id,
                        request.rank, "; ".join(f"{a}: {e}" for a, e in failed.items()))
        else:
            log.info("request %d (rank %d) replicated to %s", request.id, request.rank,
                     ", ".join(request.replication["holders"]))
        if request.jobs_pending == 0:
            self.daemon._settle(request)

    def _on_fetch_done(self, body: dict) -> None:
        fetch = self._fetches.pop(body["fetch_id"], None)
        if fetch is None:
            return
        if body["ok"]:
            log.info("rank %d: got rank %d's part of iteration %d from %s", fetch["rank"],
                     fetch["owner"], fetch["iteration"], body.get("holder"))
            self.daemon._send(fetch["identity"], MessageType.REPLY, fetch["msg_id"],
                              {"path": body["path"], "holder": body.get("holder"),
                               "tried": body["tried"]})
            return
        tried = "; ".join(f"{t['holder']}: {t['error']}" for t in body["tried"]) or "none"
        message = (f"rank {fetch['owner']}'s part of iteration {fetch['iteration']} (session "
                   f"{fetch['session']!r}) is not available from any holder; holders tried: "
                   f"{tried}")
        log.error("rank %d: %s", fetch["rank"], message)
        self.daemon._send(fetch["identity"], MessageType.ERROR, fetch["msg_id"], protocol.error_body(
            ErrorCode.PART_UNAVAILABLE, message,
            "no node holds a verified copy any more; load an older iteration or a persistent "
            "checkpoint", rank=fetch["owner"], iteration=fetch["iteration"],
            holders_tried=body["tried"]))

    # ------------------------------------------------------------------ status
    def peers_status(self) -> list:
        """Peer daemons and their health, for the status document."""
        return list(self.replicator.snapshot["peers"]) if self.replicator is not None else []

    def checkpoints_status(self) -> list:
        """Local checkpoint parts held here (own and replicas), for the status document."""
        if self.store is None:
            return []
        held = []
        for session in self.store.sessions():
            peers = self.sessions.get(session.session_id)
            for part in self.store.inventory(session, verify=False):
                entry = peers.peers[part["owner"]] if peers and part["owner"] < len(peers.peers) else None
                kind = "unknown" if not entry else "own" if entry[0] == self.address else "replica"
                if self.address is None:
                    kind = "own"
                held.append({**part, "kind": kind})
        return held

    def replication_status(self) -> dict:
        """This daemon's peer address, key and the part streams in flight."""
        if self.replicator is None:
            return {"address": None, "public_key": None, "streams": []}
        return {"address": self.address, "public_key": self.replicator.public_key,
                "streams": list(self.replicator.snapshot["streams"])}


def _iteration(body: dict, error) -> int:
    iteration = body.get("iteration")
    if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
        raise error(ErrorCode.BAD_REQUEST, f"iteration {iteration!r} is not a non-negative int")
    return iteration
