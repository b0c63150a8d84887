"""The key exchange of local checkpoints: every rank's daemon, known to every daemon.

Before parts can be replicated, each daemon must know the addresses (control and bulk)
and CURVE public key of the daemons of its clique mates, and accept only those. The
trainers carry that table over their own process group: each rank asks its daemon for
its entry, the table is all-gathered, checked (:func:`check_peer_table`: every daemon
listens, all protect bulk bytes alike, none advertises a loopback address to another
host), and every rank hands its daemon the whole table and the cliques. Only public keys
travel: two daemons derive their bulk connection keys from their own secret and the
other's public key. A :class:`SessionRegistration` does that once per daemon
incarnation (again after a daemon restarted) and keeps the table, which also orders the
holders a part is fetched from (the shared :func:`ckptd.protocol.holder_order`).
"""

from __future__ import annotations

import logging
from typing import Callable

from ckptd import protocol
from ckptd.protocol import LocalSession, MessageType
from ckpt_client.collectives import all_gather, any_rank, raise_if_any_failed, rank_and_world
from ckpt_client.transport.connection import DaemonConnection
from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError

log = logging.getLogger(__name__)


def check_peer_table(gathered: list[dict]) -> None:
    """Refuse a table whose daemons cannot all reach each other (same on every rank).

    Raises
    ------
    ValueError
        If a daemon has no peer address, the daemons protect bulk bytes differently, or a
        daemon advertises a loopback address to daemons on other hosts (or in other
        network namespaces), which could never reach it.
    """
    missing = [r for r, g in enumerate(gathered) if not g["address"]]
    if missing:
        raise ValueError(f"replication needs every node's ckptd to listen for peers, but the "
                         f"daemons of ranks {missing} have no --peer-listen address")
    choices = {g["encryption"] for g in gathered}
    if len(choices) > 1:
        raise ValueError(f"the job's daemons protect replicas differently ({sorted(map(str, choices))}); "
                         "start every ckptd of the job with the same --peer-encryption")
    networks = {g["network"] for g in gathered}
    if len(networks) > 1:
        loopback = sorted({(r, g["address"]) for r, g in enumerate(gathered)
                           if protocol.is_loopback_address(g["address"])})
        if loopback:
            rank, address = loopback[0]
            raise ValueError(
                f"the ckptd of rank {rank} advertises the loopback address {address}, which "
                "daemons on other nodes cannot reach; start it with --peer-listen on an address "
                "of this node, or --peer-advertise <address other nodes reach it at>")


class SessionRegistration:
    """Which daemon knows a local-checkpoint session, and every rank's daemon.

    Parameters
    ----------
    session_id : str
        The session.
    root : str
        Its ``root_local_ckpt_dir``.
    repl_strategy : CliqueReplicationStrategy or None
        The cliques (``None``: no replication).
    """

    def __init__(self, session_id: str, root: str, repl_strategy=None) -> None:
        self.session_id = session_id
        self.root = root
        self.repl_strategy = repl_strategy
        self.registered_with: int | None = None  # daemon pid the session was registered with
        self.table: list = []  # per rank: [address, key] or None

    def ensure(self, connect: Callable[[], DaemonConnection],
               agree: bool = True) -> tuple[DaemonConnection, bool]:
        """Register the session (the key exchange) on every rank if any rank needs it.

        With ``agree=False`` (``save``, which must not add a collective that would order
        the ranks' saves) only the first call registers; a daemon restarted since then
        refuses the save with a clear error, and the next ``find_latest`` re-registers.

        Returns
        -------
        (connection, registered_now)
        """
        connection, error, unavailable = None, None, None
        try:
            connection = connect()
        except DaemonUnavailableError as exc:
            error, unavailable = str(exc), exc
        stale = connection is None or self.registered_with != connection.daemon_pid
        if agree:
            stale = any_rank(stale)
        elif self.registered_with is not None:
            if unavailable is not None:
                raise unavailable
            return connection, False
        if not stale:
            return connection, False
        self._register(connection, error)
        return connection, True

    def _register(self, connection: DaemonConnection | None, error: str | None) -> None:
        rank, world_size = rank_and_world()
        info = None
        try:
            if connection is not None:
                info = connection.call(protocol.MessageType.PEER_INFO)
        except (DaemonUnavailableError, DaemonRequestError) as exc:
            error = str(exc)
        gathered = all_gather({k: getattr(info, k, None) for k in (
            "address", "public_key", "bulk_address", "encryption", "network")})
        self.table = [[g["address"], g["public_key"], g["bulk_address"]] if g["address"] else None
                      for g in gathered]
        raise_if_any_failed("local checkpoints: asking the daemons for their peer keys failed",
                            error)
        cliques = self.cliques(world_size)
        if any(len(c) > 1 for c in cliques):
            check_peer_table(gathered)
        try:
            connection.call(MessageType.LOCAL_SESSION, LocalSession(
                session=self.session_id, root=self.root, world_size=world_size,
                peers=self.table, cliques=cliques))
        except (DaemonUnavailableError, DaemonRequestError, AttributeError) as exc:
            error = f"rank {rank}: registering local session {self.session_id!r} at {self.root} " \
                    f"failed: {exc}"
        # every daemon knows every key before any part is pushed
        raise_if_any_failed("local checkpoints: registering the session failed", error)
        self.registered_with = connection.daemon_pid
        log.info("rank %d: local session %r at %s registered (replication %s)", rank,
                 self.session_id, self.root, cliques or "off")

    def cliques(self, world_size: int) -> list:
        """The replication cliques (empty without replication).

        Raises
        ------
        ValueError
            If the strategy was made for another world size.
        """
        if self.repl_strategy is None:
            return []
        if self.repl_strategy.world_size != world_size:
            raise ValueError(f"the replication strategy covers {self.repl_strategy.world_size} "
                             f"ranks but the process group has {world_size}")
        return self.repl_strategy.cliques

    def address_of(self, rank: int) -> str | None:
        """The peer address of ``rank``'s daemon (``None`` if it has none)."""
        entry = self.table[rank] if 0 <= rank < len(self.table) else None
        return entry[0] if entry else None

    def order_holders(self, owner: int, nodes: list) -> list:
        """Holders of ``owner``'s part, in a fixed order: clique mates after the owner, then
        the other nodes by their lowest rank."""
        first_rank = {}
        for r, entry in enumerate(self.table):
            if entry is not None:
                first_rank.setdefault(entry[0], r)
        order = []
        if self.repl_strategy is not None:
            clique = self.repl_strategy.clique_of(owner)
            order = [self.table[m][0] for m in protocol.holder_order(clique, owner)
                     if self.table[m]]
        rank_of = lambda node: (order.index(node) if node in order else len(order),
                                first_rank.get(node, 1 << 30), node)
        return sorted(set(nodes), key=rank_of)
