"""Which local checkpoint is the latest complete one, and who holds each of its parts.

:func:`choose_latest` turns every node's inventory (all-gathered by ``find_latest``) into
a :class:`Latest`: the newest committed iteration whose every part is held, verified, on
some node; who holds each part (in the fetch order); this node's own entries (where their
files are, and where the daemon still keeps them in memory);
and, when a newer committed iteration lost some parts on every node, which ones (a clear
error instead of a silent fallback). A pure function: no connection, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ckptd.protocol import HeldPart, LocalInventoryReply

#: How a node whose daemon has no peer socket is named among holders (never fetched from).
NO_PEER_SOCKET = "node of rank "


@dataclass
class Latest:
    """What ``find_latest`` found (see :func:`choose_latest`)."""

    iteration: int = -1
    holders: dict = field(default_factory=dict)    # owner -> holder addresses, fetch order
    own_parts: dict[int, HeldPart] = field(default_factory=dict)  # owner -> part held here
    incomplete: tuple | None = None                # (newer iteration, owners held nowhere)

    def missing_text(self) -> str:
        """Why a newer committed iteration is not loadable ('' when none is)."""
        if self.incomplete is None:  # choose_latest records only iterations newer than its pick
            return ""
        iteration, lost = self.incomplete
        return (f"iteration {iteration} was committed, but no node holds the parts of ranks "
                f"{lost} any more (all the nodes of their clique lost them)")


def choose_latest(gathered: list, own_inventory: LocalInventoryReply, world_size: int,
                  order_holders: Callable[[int, list], list]) -> Latest:
    """The newest committed iteration every part of which some node holds, verified.

    Parameters
    ----------
    gathered : list
        ``(rank, inventory, error)`` of every rank (inventories of one node repeat).
    own_inventory : ckptd.protocol.LocalInventoryReply
        This rank's daemon's inventory.
    order_holders : callable
        ``order_holders(owner, nodes)``: the holders of a part in fetch order.
    """
    holders: dict[tuple, list] = {}
    committed: set = set()
    seen: set = set()
    for other, inventory, _ in gathered:
        node = inventory.address or f"{NO_PEER_SOCKET}{other}"  # no sharing without one
        if node in seen:
            continue  # several ranks share a daemon
        seen.add(node)
        for part in inventory.parts:
            if part.committed:
                committed.add(part.iteration)
            if part.verified:
                holders.setdefault((part.iteration, part.owner), []).append(node)
    latest = Latest()
    for iteration in sorted(committed, reverse=True):
        lost = [owner for owner in range(world_size) if (iteration, owner) not in holders]
        if not lost:
            latest.iteration = iteration
            break
        latest.incomplete = latest.incomplete or (iteration, lost)
    if latest.iteration >= 0:
        latest.holders = {owner: order_holders(owner, holders[(latest.iteration, owner)])
                          for owner in range(world_size)}
        latest.own_parts = {p.owner: p for p in own_inventory.parts
                            if p.iteration == latest.iteration and p.verified}
    return latest
