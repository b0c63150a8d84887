"""Clique formation of CliqueReplicationStrategy, and the part format's header."""

from __future__ import annotations

import pytest

from ckpt_client.local import CliqueReplicationStrategy
from ckptd import protocol


@pytest.mark.parametrize("jump, factor, world, cliques", [
    (1, 2, 4, [[0, 1], [2, 3]]),
    (2, 2, 4, [[0, 2], [1, 3]]),
    (2, 2, 8, [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (4, 2, 8, [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (1, 3, 6, [[0, 1, 2], [3, 4, 5]]),
    (2, 3, 6, [[0, 2, 4], [1, 3, 5]]),
    (1, 1, 3, [[0], [1], [2]]),
])
def test_cliques_follow_jump_and_factor(jump, factor, world, cliques):
    strategy = CliqueReplicationStrategy.from_replication_params(jump, factor, world_size=world)
    assert strategy.cliques == cliques
    assert strategy.replication_factor == factor
    for clique in cliques:
        for rank in clique:
            assert strategy.clique_of(rank) == clique


@pytest.mark.parametrize("jump, factor, world", [(1, 2, 3), (2, 2, 6), (4, 2, 4), (1, 3, 4),
                                                 (3, 2, 9)])
def test_uneven_cliques_are_refused(jump, factor, world):
    with pytest.raises(ValueError) as info:
        CliqueReplicationStrategy.from_replication_params(jump, factor, world_size=world)
    text = str(info.value)
    assert f"world size {world}" in text and f"= {jump * factor}" in text


@pytest.mark.parametrize("jump, factor", [(0, 2), (1, 0), (-1, 2), (1.5, 2)])
def test_bad_parameters_are_refused(jump, factor):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        CliqueReplicationStrategy.from_replication_params(jump, factor, world_size=4)


def test_world_size_is_needed_without_a_process_group():
    with pytest.raises(ValueError, match="world_size"):
        CliqueReplicationStrategy.from_replication_params(1, 2)


def test_explicit_cliques_must_cover_every_rank_once():
    with pytest.raises(ValueError, match="exactly once"):
        CliqueReplicationStrategy([[0, 1], [1, 2]])


def test_part_header_round_trip_and_garbage():
    buffers = [["float32", [2, 3], 24], ["int64", [], 8]]
    encoded = protocol.encode_part_header(b"skel", buffers, 3, 42, "s")
    header, offset = protocol.decode_part_header(encoded + b"tensor bytes")
    assert offset == len(encoded)
    assert header == {"skeleton": b"skel", "buffers": buffers, "owner": 3, "iteration": 42,
                      "session": "s", "version": 2}
    for bad in (b"", b"NOTAPART" + bytes(8), encoded[:-1]):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode_part_header(bad)
