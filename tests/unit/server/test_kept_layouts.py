"""Which save layouts a daemon keeps per connection for a later STAGE to name: the last
``CKPTD_SENT_AHEAD_KINDS`` torch saves' and, apart, as many DCP saves', so that a DCP save
streamed in many requests never pushes the torch layouts out, and a trainer guessing
several kinds of DCP state dict in turn finds each kind's last layout kept."""

from __future__ import annotations

from types import SimpleNamespace

from ckptd.protocol import SaveFormat
from ckptd.server.new_requests import _keep_layout
from ckptd.server.ranks import RankInfo


def kept_after(formats: list) -> dict:
    rank = RankInfo(rank=0, routing_id=b"r", pid=1, world_size=1)
    for number, fmt in enumerate(formats, start=1):
        _keep_layout(rank, SimpleNamespace(id=number, buffers=[], offsets=[],
                                           extent_length=0, format=fmt))
    return {fmt: list(kept) for fmt, kept in rank.layouts.items()}


def test_many_dcp_requests_keep_the_torch_layouts():
    torch_kinds = [SaveFormat.TORCH] * 3
    assert kept_after(torch_kinds + [SaveFormat.DCP] * 20) == {
        SaveFormat.TORCH: [1, 2, 3], SaveFormat.DCP: list(range(16, 24))}
    assert kept_after([SaveFormat.DCP, SaveFormat.TORCH, SaveFormat.DCP, SaveFormat.DCP]) \
        == {SaveFormat.TORCH: [2], SaveFormat.DCP: [1, 3, 4]}


def test_each_format_is_bounded_by_the_knob(monkeypatch):
    monkeypatch.setenv("CKPTD_SENT_AHEAD_KINDS", "4")
    assert kept_after([SaveFormat.TORCH, SaveFormat.DCP] * 6) == {
        SaveFormat.TORCH: [5, 7, 9, 11], SaveFormat.DCP: [6, 8, 10, 12]}
    monkeypatch.setenv("CKPTD_SENT_AHEAD_KINDS", "0")
    assert kept_after([SaveFormat.TORCH, SaveFormat.DCP]) == {
        SaveFormat.TORCH: [], SaveFormat.DCP: []}
