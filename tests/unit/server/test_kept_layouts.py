"""Which save layouts a daemon keeps per connection for a later STAGE to name: every
torch save's (up to ``CKPTD_SENT_AHEAD_KINDS``), and only the last two DCP saves', so
that a DCP save streamed in many requests never pushes the torch layouts out."""

from __future__ import annotations

from types import SimpleNamespace

from ckptd.protocol import SaveFormat
from ckptd.server.new_requests import _keep_layout
from ckptd.server.ranks import RankInfo


def kept_after(formats: list) -> list:
    rank = RankInfo(rank=0, routing_id=b"r", pid=1, world_size=1)
    for number, fmt in enumerate(formats, start=1):
        _keep_layout(rank, SimpleNamespace(id=number, buffers=[], offsets=[],
                                           extent_length=0, format=fmt))
    return list(rank.layouts)


def test_many_dcp_requests_keep_the_torch_layouts_and_the_last_two_dcp_ones():
    torch_kinds = [SaveFormat.TORCH] * 3
    assert kept_after(torch_kinds + [SaveFormat.DCP] * 20) == [1, 2, 3, 22, 23]
    assert kept_after([SaveFormat.DCP, SaveFormat.TORCH, SaveFormat.DCP, SaveFormat.DCP]) \
        == [2, 3, 4]


def test_torch_layouts_are_bounded_by_the_knob(monkeypatch):
    monkeypatch.setenv("CKPTD_SENT_AHEAD_KINDS", "4")
    assert kept_after([SaveFormat.TORCH] * 6) == [3, 4, 5, 6]
