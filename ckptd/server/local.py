"""The local-checkpoint service: sessions, the replication step of a save, inventory, fetch.

Owns the daemon's half of ``ckpt_client.LocalCheckpointManager``:

- ``PEER_INFO`` / ``LOCAL_SESSION``: the key exchange. Each rank asks its daemon for its
  peer address and CURVE public key, the trainers all-gather them over their own process
  group, and every rank hands its daemon the whole table (rank -> address, key) and the
  replication cliques. Only keys in those tables may connect to the peer socket; the
  daemon keeps links only to its clique mates' daemons (any other is dialed on demand).
- the replication step of a ``local`` save: once staged, :meth:`start_replication` has the
  replicator stream the extent to the daemons of the owner's clique mates (in the shared
  :func:`ckptd.protocol.holder_order`) while the writers write the local part; each
  push's outcome goes to the save lifecycle, which keeps the extent until the last one.
  A failed or timed-out peer makes the save *reduced redundancy*, never a hang.
- ``LOCAL_INVENTORY`` (parts held, verified, with the identity of each file as verified
  and where a part resident in memory is), ``LOCAL_FETCH`` (a missing or corrupted part
  from the holders, in the order given, answered when the replicator reports; a corrupted
  copy here is first set aside, never deleted) and ``LOCAL_COMMIT`` (all ranks agreed:
  mark committed, drop older iterations, and older resident parts);
- the end of a ``local`` save: its part is noted verified (its writer checksummed those
  very bytes), kept in memory (:mod:`ckptd.server.resident`) and its copies recorded
  (:mod:`ckptd.server.redundancy`).

Files are ``ckptd.storage.local_store``'s business, the network ``ckptd.replication``'s.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ckptd.protocol import (Empty, ErrorCode, HeldPart, LocalCommit, LocalCommitReply,
                            LocalFetch, LocalInventory, LocalInventoryReply,
                            LocalSession, LocalSessionReply, PeerInfoReply, SaveFormat,
                            holder_order)
from ckptd.replication.commands import (CancelPush, ConnectPeers, Fetch, FetchDone, PartRef,
                                        Push, PushDone, SetPeers)
from ckptd.replication.replicator import Replicator
from ckptd.server import local_status
from ckptd.server.endpoint import DEFERRED, Call, RequestError
from ckptd.server.local_fetches import PendingFetches
from ckptd.server.local_parts import part_ranges
from ckptd.server.redundancy import RedundancyLedger
from ckptd.server.requests import ReplicaSet, SaveRequest, host_name
from ckptd.server.resident import ResidentParts
from ckptd.storage.directories import make_directories
from ckptd.storage.local_store import LocalStore, LocalStoreError
from ckptd.storage.local_store import LocalSession as StoredSession
from ckptd.storage.roots import AllowedRoots

log = logging.getLogger(__name__)


def network_namespace_id() -> str:
    """Which host and network namespace this process runs in (two daemons with the same
    id reach each other's loopback addresses; others cannot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            machine = f.read().strip()
    except OSError:
        machine = host_name()
    try:
        namespace = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        namespace = 0
    return f"{machine}/netns:{namespace}"


@dataclass
class SessionPeers:
    """What the trainers told this daemon about one session's daemons and cliques."""

    peers: list  # per rank: [address, public key, bulk address] or None
    cliques: list = field(default_factory=list)

    def holder(self, address: str) -> tuple | None:
        """``(address, key, bulk address)`` of the daemon at ``address``, if in the table."""
        return next((tuple(entry) for entry in self.peers if entry and entry[0] == address),
                    None)

    def clique_of(self, rank: int) -> list:
        """The clique ``rank`` belongs to (``[rank]`` without replication)."""
        return next((list(c) for c in self.cliques if rank in c), [rank])

    def mates_of(self, address: str) -> set[str]:
        """Addresses of the other daemons holding a rank of a clique that one of the ranks
        of the daemon at ``address`` belongs to (whom that daemon replicates with)."""
        mates: set[str] = set()
        for clique in self.cliques:
            entries = [e for rank in clique if (e := self.entry_of(rank))]
            if any(e[0] == address for e in entries):
                mates |= {e[0] for e in entries if e[0] != address}
        return mates

    def entry_of(self, rank: int) -> list | None:
        """``[address, key]`` of ``rank``'s daemon, if known."""
        return self.peers[rank] if 0 <= rank < len(self.peers) else None


class LocalService:
    """The daemon's local-checkpoint service (see the module docstring).

    Parameters
    ----------
    daemon : ckptd.server.daemon.Daemon
        For the configuration, ranks, the staging pool and the save lifecycle.
    """

    def __init__(self, daemon) -> None:
        self.daemon = daemon
        self.store: LocalStore | None = None
        self.replicator: Replicator | None = None
        self.sessions: dict[str, SessionPeers] = {}
        self.resident: ResidentParts | None = None
        self.redundancy = RedundancyLedger()
        self.fetches = PendingFetches()  # answered on FetchDone
        self._pushed: dict[tuple, int] = {}  # (request id, peer) -> bytes acknowledged

    def routes(self) -> dict:
        """Message body type -> handler (``PEER_INFO`` has an empty body)."""
        return {LocalSession: self.on_local_session, LocalInventory: self.on_local_inventory,
                LocalFetch: self.on_local_fetch, LocalCommit: self.on_local_commit}

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Open the store; start the replicator when ``--peer-listen`` was given."""
        config = self.daemon.config
        if config.local_dir:
            make_directories(config.local_dir)
            allowed = AllowedRoots.of([config.local_dir])
        else:
            allowed = self.daemon.roots
        self.store = LocalStore(allowed, self.daemon.journal)
        self.resident = ResidentParts(self.daemon.pool)
        lifecycle = self.daemon.saves.lifecycle
        lifecycle.on_done, lifecycle.reclaim = self._save_done, self.resident.reclaim
        if config.peer_listen:
            pool = self.daemon.pool
            self.replicator = Replicator(config.peer_listen, self.store, pool.path, pool.size,
                                         config.peer_advertise, config.peer_encryption)
            self.replicator.start()

    @property
    def address(self) -> str | None:
        """This daemon's peer address (``None`` without ``--peer-listen``)."""
        return self.replicator.address if self.replicator is not None else None

    def on_event(self, event) -> None:
        """A :class:`PushDone` or :class:`FetchDone` from the replicator."""
        if isinstance(event, PushDone):
            request = self.daemon.table.find(event.request_id)
            if request is not None:
                self.daemon.saves.lifecycle.replica_done(request, event.holder, event.ok,
                                                         event.error, event.nbytes)
        elif isinstance(event, FetchDone):
            self.fetches.done(event, self.store)

    def release_resident(self) -> None:
        """Give every resident part's space back (the daemon is stopping)."""
        if self.resident is not None:
            self.resident.release_all()

    def stop(self) -> None:
        """Stop replicating (streams in flight are dropped; peers time them out)."""
        if self.replicator is not None:
            self.replicator.stop()
            self.replicator = None

    # ------------------------------------------------------------------ handlers
    def _session(self, session_id: str) -> StoredSession:
        try:
            return self.store.session(session_id)
        except LocalStoreError as exc:
            raise RequestError(ErrorCode.NOT_CONFIGURED, str(exc)) from None

    def on_peer_info(self, call: Call, body: Empty) -> PeerInfoReply:
        """This daemon's peer addresses, CURVE public key and bulk protection (``None``
        without peers), and where it runs (host and network namespace: a loopback address
        is reachable only from the same pair)."""
        replicator = self.replicator
        return PeerInfoReply(address=self.address,
                             public_key=replicator.public_key if replicator else None,
                             bulk_address=replicator.bulk_address if replicator else None,
                             encryption=replicator.protection if replicator else None,
                             local_dir=self.daemon.config.local_dir, host=host_name(),
                             network=network_namespace_id(), pid=os.getpid())

    def on_local_session(self, call: Call, body: LocalSession) -> LocalSessionReply:
        """Register a session's root, its peer table and cliques."""
        rank = self.daemon.ranks.of(call.routing_id)
        if any(len(c) > 1 for c in body.cliques) and self.replicator is None:
            raise RequestError(ErrorCode.NOT_CONFIGURED,
                               f"rank {rank.rank}: replication needs peer daemons, but this "
                               "ckptd has no peer socket",
                               "start ckptd with --peer-listen tcp://<node address>:<port>")
        try:
            session = self.store.register(body.session, body.root)
        except LocalStoreError as exc:
            raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
        self.sessions[session.session_id] = SessionPeers(body.peers, body.cliques)
        if self.replicator is not None:
            every = [p for sp in self.sessions.values() for p in sp.peers if p]
            mates = set().union(*(sp.mates_of(self.address) for sp in self.sessions.values()))
            self.replicator.command(SetPeers(sorted({tuple(p) for p in body.peers if p}),
                                             sorted({p[1] for p in every}), sorted(mates)))
        return LocalSessionReply(directory=session.directory, address=self.address)

    def on_local_inventory(self, call: Call, body: LocalInventory) -> LocalInventoryReply:
        """The parts this node holds for a session, each verified against its checksum."""
        session = self._session(body.session)
        if self.replicator is not None:  # every daemon has the key table by now: dial peers
            self.replicator.command(ConnectPeers())
        parts = self.store.inventory(session, verify=True)
        for part in parts:
            part["resident"] = self.resident.lookup(session.session_id, part["owner"],
                                                    part["iteration"])
        return LocalInventoryReply(
            address=self.address, host=host_name(),
            parts=[HeldPart(**{k: p[k] for k in ("iteration", "owner", "size", "verified",
                                                 "committed", "path", "identity", "resident")})
                   for p in parts])

    def on_local_commit(self, call: Call, body: LocalCommit) -> LocalCommitReply:
        """Every rank's save of an iteration is durable: mark it and drop older iterations
        before answering, so that when the trainer's save returns the older files are gone
        (what users of the reference API check)."""
        rank = self.daemon.ranks.of(call.routing_id)
        session = self._session(body.session)
        older = self.store.commit(session, body.iteration)
        self.resident.committed(session.session_id, body.iteration)
        log.info("rank %d committed iteration %d of session %r", rank.rank, body.iteration,
                 session.session_id)
        return LocalCommitReply(removed=older)

    def on_local_fetch(self, call: Call, body: LocalFetch):
        """Fetch a part this node lacks from the holders, in the order the client gave."""
        rank = self.daemon.ranks.of(call.routing_id)
        session = self._session(body.session)
        if self.replicator is None:
            raise RequestError(ErrorCode.NOT_CONFIGURED,
                               f"rank {rank.rank}: cannot fetch rank {body.owner}'s part of "
                               f"iteration {body.iteration}: this ckptd has no peer socket",
                               "start ckptd with --peer-listen")
        path = session.part_path(body.iteration, body.owner)
        moved_aside = self.store.set_aside_if_corrupt(path)
        peers = self.sessions.get(session.session_id) or SessionPeers([])
        keyed = [holder for address in body.holders if (holder := peers.holder(address))]
        fetch_id = self.fetches.add(call, body, moved_aside)
        log.info("rank %d: fetching rank %d's part of iteration %d from %s", rank.rank,
                 body.owner, body.iteration, ", ".join(body.holders) or "(no holder)")
        self.replicator.command(Fetch(fetch_id, PartRef(session.session_id, body.owner,
                                                        body.iteration), path, keyed))
        return DEFERRED

    def expire_fetches(self, now: float, limit: float) -> None:
        """Fail the fetches unanswered ``limit`` seconds after they were asked for."""
        self.fetches.expire(now, limit)

    # ------------------------------------------------------------------ saves
    def part_path_for(self, rank: int, session_id: str | None, iteration: int) -> str:
        """Destination of a ``local`` save (the store names it; a new save uncommits it)."""
        session = self._session(session_id)
        self.store.begin_iteration(session, iteration)
        return session.part_path(iteration, rank)

    def holders_for(self, session_id: str, owner: int) -> tuple[list, int]:
        """Daemons that keep ``owner``'s replicas (in holder order), and how many replicas
        the clique asks for."""
        peers = self.sessions.get(session_id)
        if peers is None or self.replicator is None:
            return [], 0
        clique = peers.clique_of(owner)
        seen, holders = {self.address}, []
        for mate in holder_order(clique, owner):
            entry = peers.entry_of(mate)
            if entry and entry[0] not in seen:
                seen.add(entry[0])
                holders.append(tuple(entry))
        return holders, len(clique) - 1

    def start_replication(self, request: SaveRequest) -> list[str]:
        """Stream a staged local part to its holders; returns their addresses."""
        if request.format != SaveFormat.LOCAL:
            return []
        holders, wanted = self.holders_for(request.session, request.rank)
        request.replicas = ReplicaSet.sending_to(wanted, [holder[0] for holder in holders])
        if wanted and len(holders) < wanted:
            log.warning("request %d (rank %d): only %d of %d clique mates live on other nodes; "
                        "choose replication_jump = ranks per node", request.id, request.rank,
                        len(holders), wanted)
        if holders:  # the bytes of the part file, as the writer writes them
            self.replicator.command(Push(
                request.id, PartRef(request.session, request.rank, request.iteration), holders,
                part_ranges(self.daemon.pool, request)))
        return [holder[0] for holder in holders]

    def _save_done(self, request: SaveRequest) -> None:
        """A save is done (its extent still held): a local part is verified, kept in memory
        while space allows, and its copies recorded."""
        if request.format != SaveFormat.LOCAL:
            return
        self.store.note_verified(request.path)  # its writer checksummed these very bytes
        self.resident.keep(request)
        self.redundancy.record(request, self.address)

    def note_push_progress(self) -> None:
        """A save whose pushes still move bytes is making progress (for status's stuck flag):
        only a push that stopped, as one over a cut link does, leaves its save stalled."""
        if self.replicator is None:
            return
        requests, pushed = self.daemon.table.requests, {}
        for stream in self.replicator.snapshot["streams"]:
            if stream["direction"] != "out" or stream.get("request_id") is None:
                continue
            key = (stream["request_id"], stream["peer"])
            pushed[key] = stream["bytes_done"]
            if pushed[key] > self._pushed.get(key, 0) and key[0] in requests:
                requests[key[0]].moved()
        self._pushed = pushed

    def cancel_replication(self, request: SaveRequest) -> None:
        """Stop a save's pushes (they answer with failed outcomes)."""
        if self.replicator is not None:
            self.replicator.command(CancelPush(request.id, request.error or request.phase))

    # ------------------------------------------------------------------ status
    def status_sections(self) -> dict:
        """The status document's local-checkpoint sections (:mod:`.local_status`)."""
        return local_status.sections(self)
