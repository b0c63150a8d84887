"""``choose_latest``: the newest committed iteration whose every part some node holds."""

from __future__ import annotations

from ckptd.protocol import HeldPart, LocalInventoryReply
from ckpt_client.local.latest import Latest, choose_latest


def part(iteration: int, owner: int, committed: bool = True, verified: bool = True) -> HeldPart:
    return HeldPart(iteration=iteration, owner=owner, size=64, committed=committed,
                    verified=verified, path=f"/l/iter_{iteration}/rank_{owner}.part")


def node(address, *parts) -> LocalInventoryReply:
    return LocalInventoryReply(address=address, host="h", parts=list(parts))


def in_fetch_order(owner: int, nodes: list) -> list:
    return sorted(nodes)


def gathered_from(*per_rank) -> list:
    """``(rank, inventory, error)`` per rank, as ``find_latest`` all-gathers them."""
    return [(rank, inventory, None) for rank, inventory in enumerate(per_rank)]


def test_the_newest_committed_iteration_held_everywhere_wins_with_its_holders():
    a = node("A", part(5, 0), part(5, 1), part(10, 0), part(10, 1), part(10, 2))
    b = node("B", part(5, 2), part(5, 3), part(10, 2), part(10, 3), part(10, 0))
    latest = choose_latest(gathered_from(a, a, b, b), a, 4, in_fetch_order)
    assert latest.iteration == 10
    assert latest.holders == {0: ["A", "B"], 1: ["A"], 2: ["A", "B"], 3: ["B"]}
    assert sorted(latest.own_parts) == [0, 1, 2] and latest.own_parts[1].iteration == 10
    assert latest.incomplete is None and latest.missing_text() == ""


def test_a_newer_iteration_with_a_part_held_nowhere_is_reported_not_loaded():
    a = node("A", part(5, 0), part(5, 1), part(10, 0))
    b = node("B", part(5, 1), part(10, 1, verified=False))  # rank 1's replica is corrupt
    latest = choose_latest(gathered_from(a, b), a, 2, in_fetch_order)
    assert latest.iteration == 5
    assert latest.incomplete == (10, [1])
    assert "iteration 10" in latest.missing_text() and "[1]" in latest.missing_text()


def test_uncommitted_iterations_do_not_count():
    a = node("A", part(3, 0), part(4, 0, committed=False))
    latest = choose_latest(gathered_from(a), a, 1, in_fetch_order)
    assert latest.iteration == 3 and latest.incomplete is None


def test_nothing_committed_is_minus_one():
    a = node("A", part(4, 0, committed=False))
    latest = choose_latest(gathered_from(a), a, 1, in_fetch_order)
    assert latest == Latest() and latest.missing_text() == ""


def test_ranks_sharing_a_daemon_count_its_inventory_once():
    a = node("A", part(7, 0), part(7, 1), part(7, 2))
    latest = choose_latest(gathered_from(a, a, a), a, 3, in_fetch_order)
    assert latest.holders == {0: ["A"], 1: ["A"], 2: ["A"]}


def test_daemons_without_a_peer_address_are_told_apart_by_rank():
    a, b = node(None, part(1, 0)), node(None, part(1, 1))
    latest = choose_latest(gathered_from(a, b), b, 2, in_fetch_order)
    assert latest.holders == {0: ["node of rank 0"], 1: ["node of rank 1"]}
    assert list(latest.own_parts) == [1]


def test_holders_come_in_the_order_the_caller_gives():
    a, b, c = (node(n, part(2, 0)) for n in "ABC")
    latest = choose_latest(gathered_from(a, b, c), a, 1,
                           lambda owner, nodes: sorted(nodes, reverse=True))
    assert latest.holders == {0: ["C", "B", "A"]}
