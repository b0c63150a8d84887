"""Typed bodies: the machinery (types, checks, defaults, unknown keys) and the client
channel's request bodies."""

import pytest

from ckptd import protocol
from ckptd.protocol import Body, ErrorCode, ProtocolError, check


class Sample(Body, message="sample"):
    count: int = check(lambda v: v > 0, "a positive count")
    name: str = "x"
    ratio: float = 1.0
    ids: list[int] = check(lambda v: len(v) < 3, "at most two ids", [])
    maybe: str | None = None


def test_a_body_round_trips_and_keeps_its_message_type():
    body = Sample(2, "n", 0.5, [1], None)
    assert Sample.message_type == "sample"
    assert Sample.from_wire(body.to_wire()) == body


def test_defaults_fill_missing_optional_fields_and_mutable_defaults_are_not_shared():
    a, b = Sample.from_wire({"count": 1}), Sample.from_wire({"count": 1})
    assert (a.name, a.ratio, a.maybe) == ("x", 1.0, None)
    assert a.ids == [] and a.ids is not b.ids


@pytest.mark.parametrize("wire, complaint", [
    ({}, "sample needs 'count'"),
    ({"count": 0}, "'count' = 0 is not a positive count"),
    ({"count": True}, "'count' = True"),        # a bool is not an int on the wire
    ({"count": 1, "ratio": "fast"}, "'ratio'"),
    ({"count": 1, "ids": [1, "2"]}, "'ids'"),
    ({"count": 1, "ids": [1, 2, 3]}, "at most two ids"),
    ({"count": 1, "maybe": 5}, "'maybe'"),
])
def test_each_field_is_checked_and_the_error_names_it(wire, complaint):
    with pytest.raises(ProtocolError, match=complaint) as info:
        Sample.from_wire(wire)
    assert info.value.code == ErrorCode.BAD_REQUEST


def test_an_int_is_a_float_on_the_wire():
    assert Sample.from_wire({"count": 1, "ratio": 2}).ratio == 2


def test_a_long_bad_value_is_shortened_in_the_message():
    with pytest.raises(ProtocolError) as info:
        Sample.from_wire({"count": 1, "name": ["y"] * 500})
    assert len(info.value.message) < 200 and "..." in info.value.message


def test_a_field_type_the_wire_cannot_carry_is_a_programming_error():
    class Odd(Body, message="odd"):
        when: set

    with pytest.raises(TypeError, match="cannot be declared"):
        Odd.from_wire({"when": []})


def test_unknown_fields_are_ignored_so_a_newer_client_can_add_optional_ones():
    assert protocol.Hello.from_wire({"rank": 1, "pid": 2, "new_field": 3}).rank == 1


def test_an_empty_body_needs_nothing():
    assert protocol.Empty.from_wire({"anything": 1}).to_wire() == {}


def test_a_stage_body_is_checked_field_by_field_and_as_a_whole():
    good = {"format": "dcp", "path": "/ckpt/s", "buffers": [["float32", [2, 2], 16]],
            "files": [["__0_0.distcp", [0]]]}
    stage = protocol.Stage.from_wire(good)
    assert stage.files == [["__0_0.distcp", [0]]] and stage.cuda is None
    for field, bad in (("buffers", [["float32", [2], -1]]), ("buffers", [["object", [1], 8]]),
                       ("buffers", [[["float32"], [1], 8]]), ("buffers", [["int8", [True], 1]]),
                       ("buffers", [["int8", [1], True]]), ("buffers", [["int8", [-1], 1]]),
                       ("buffers", [["int8", (1,), 1]]), ("buffers", [["int8", [1]]]),
                       ("buffers", [["int8", [1], 1], "x"]),
                       ("files", [[".metadata", [0]]]), ("files", [["a/b", [0]]]),
                       ("format", "pickle")):
        with pytest.raises(ProtocolError, match=f"'{field}'") as info:
            protocol.Stage.from_wire({**good, field: bad})
        assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(ProtocolError, match="beyond the 1 described"):
        protocol.Stage.from_wire({**good, "files": [["f.distcp", [0, 1]]]})
    with pytest.raises(ProtocolError, match="needs 'iteration'"):
        protocol.Stage.from_wire({**good, "format": "local"})
    with pytest.raises(ProtocolError, match="one entry .* per buffer"):
        protocol.Stage.from_wire({**good, "cuda": []})
    mixed = protocol.Stage.from_wire({**good, "cuda": [None]})
    assert mixed.cuda == [None]


def test_a_stage_may_name_an_earlier_saves_layout_instead_of_its_buffers():
    """``layout_of`` stands for a torch or DCP save's whole layout: alone, never beside
    buffers, CUDA specs or for a local part, and never a negative id. A DCP save's files
    come with it, their buffer indices checked only once the daemon looked the layout up
    (:meth:`Stage.check_files`)."""
    named = {"format": "torch", "path": "/ckpt/m.pt", "buffers": [], "layout_of": 7}
    assert protocol.Stage.from_wire(named).layout_of == 7
    assert protocol.Stage.from_wire({**named, "layout_of": None}).layout_of is None
    dcp = protocol.Stage.from_wire({**named, "format": "dcp", "files": [["a.distcp", [0, 5]]]})
    assert dcp.layout_of == 7 and dcp.files == [["a.distcp", [0, 5]]]
    with pytest.raises(ProtocolError, match="'a.distcp' names a buffer beyond the 0"):
        dcp.check_files()
    for change, needle in (({"buffers": [["int8", [1], 1]]}, "without buffers"),
                           ({"cuda": []}, "without buffers or cuda"),
                           ({"format": "local", "iteration": 1}, "a torch or DCP save's"),
                           ({"layout_of": -1}, "'layout_of'")):
        with pytest.raises(ProtocolError, match=needle) as info:
            protocol.Stage.from_wire({**named, **change})
        assert info.value.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("peers, ok", [
    ([None, ["tcp://a:1", "key"], ["tcp://b:1", "key", "b:2"]], True),
    ([["tcp://a:1"]], False),
    ([["tcp://a:1", 5]], False),
])
def test_a_local_session_names_each_peer_by_address_and_key(peers, ok):
    wire = {"root": "/local", "peers": peers}
    if ok:
        assert protocol.LocalSession.from_wire(wire).peers == peers
    else:
        with pytest.raises(ProtocolError, match="'peers'"):
            protocol.LocalSession.from_wire(wire)


def test_an_abort_may_name_stage_messages_and_an_older_clients_abort_still_reads():
    """A trainer that gave up on a STAGE's reply names that STAGE message; an abort from
    a ckpt_client that knows no such field names none (and still names its requests)."""
    abort = protocol.Abort(request_ids=[], stages=[7], reason="gave up")
    assert protocol.Abort.from_wire(abort.to_wire()) == abort
    older = protocol.Abort.from_wire({"request_ids": [3], "reason": "close(abort=True)"})
    assert older.stages == [] and older.request_ids == [3]
    with pytest.raises(ProtocolError, match="'stages'"):
        protocol.Abort.from_wire({"request_ids": [], "stages": [-1], "reason": "x"})
    with pytest.raises(ProtocolError, match="'stages'"):
        protocol.Abort.from_wire({"request_ids": [], "stages": ["7"], "reason": "x"})
