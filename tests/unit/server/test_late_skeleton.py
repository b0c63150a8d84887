"""A torch save's skeleton that comes with STAGED (its STAGE was sent ahead without one)."""

import pytest

from ckptd.protocol import ErrorCode, SaveFormat, pack_value
from ckptd.server.endpoint import RequestError
from ckptd.server.requests import SaveRequest
from ckptd.server.saves import _take_late_skeleton


class Lifecycle:
    """Records the requests it was told to fail (the real one needs a staging pool)."""

    def __init__(self) -> None:
        self.failed: list = []

    def fail(self, request, reason, trainer_may_copy=False, code=None):
        self.failed.append((request.id, code, reason))


def request(fmt: str, skeleton: bytes = b"") -> SaveRequest:
    return SaveRequest(id=7, rank=0, routing_id=b"c", format=fmt, path="/ckpt/m.pt",
                       buffers=[], offsets=[], extent_length=0, skeleton=skeleton)


def test_a_skeleton_sent_with_staged_is_the_saves_skeleton():
    torch_save, lifecycle = request(SaveFormat.TORCH), Lifecycle()
    _take_late_skeleton(torch_save, pack_value({"step": 3}), lifecycle)
    assert torch_save.skeleton == pack_value({"step": 3})
    early = request(SaveFormat.TORCH, pack_value({"step": 1}))
    _take_late_skeleton(early, None, lifecycle)  # its STAGE carried it
    assert early.skeleton == pack_value({"step": 1})
    assert lifecycle.failed == []


@pytest.mark.parametrize("skeleton", [None, b""])
def test_a_torch_save_that_never_got_a_skeleton_is_refused_naming_what_is_missing(skeleton):
    """Else its writer met an empty skeleton and failed with an unpack error. It is ended
    at once, with the reply's code and message."""
    lifecycle = Lifecycle()
    with pytest.raises(RequestError) as info:
        _take_late_skeleton(request(SaveFormat.TORCH), skeleton, lifecycle)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "request 7 (/ckpt/m.pt) is a torch save with no skeleton" in info.value.message
    assert "STAGED" in info.value.message
    assert lifecycle.failed == [(7, ErrorCode.BAD_REQUEST, info.value.message)]


def test_a_skeleton_for_another_format_is_refused():
    lifecycle = Lifecycle()
    with pytest.raises(RequestError) as info:
        _take_late_skeleton(request(SaveFormat.DCP), pack_value({}), lifecycle)
    assert info.value.code == ErrorCode.BAD_REQUEST
    assert "only torch saves have a skeleton" in info.value.message
    assert lifecycle.failed == []
