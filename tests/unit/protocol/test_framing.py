"""Framing: a message's frames and back, the extension types, and every size limit."""

import pytest

from ckptd import protocol
from ckptd.protocol import ErrorCode, ProtocolError, TensorRef


def test_round_trip_keeps_tuples_tensor_refs_and_frames():
    frames = protocol.encode("stage", 7, {"skeleton": (1, [TensorRef(3)], {"k": None})}, [b"raw"])
    message = protocol.decode(frames)
    assert (message.type, message.id) == ("stage", 7)
    assert message.body["skeleton"] == (1, [TensorRef(3)], {"k": None})
    assert message.frames == [b"raw"]


def test_wrong_schema_version_is_refused_with_a_hint():
    header = protocol.pack_value({"v": protocol.SCHEMA_VERSION + 1, "type": "ping", "id": 1, "body": {}})
    with pytest.raises(ProtocolError) as info:
        protocol.decode([header])
    assert info.value.code == ErrorCode.BAD_VERSION
    assert "same ckptd version" in info.value.hint


@pytest.mark.parametrize("frames, code", [
    ([], ErrorCode.MALFORMED),
    ([b"\xc1 not msgpack"], ErrorCode.MALFORMED),
    ([protocol.pack_value([1, 2])], ErrorCode.MALFORMED),
    ([protocol.pack_value({"v": protocol.SCHEMA_VERSION, "type": 3, "id": 1})], ErrorCode.MALFORMED),
    ([protocol.pack_value({"v": protocol.SCHEMA_VERSION, "type": "x", "id": 1, "body": []})],
     ErrorCode.MALFORMED),
    ([b"x"] * (protocol.MAX_FRAMES + 1), ErrorCode.TOO_LARGE),
])
def test_malformed_messages_are_refused(frames, code):
    with pytest.raises(ProtocolError) as info:
        protocol.decode(frames)
    assert info.value.code == code


def test_oversized_header_is_refused():
    with pytest.raises(ProtocolError) as info:
        protocol.decode([b"\x00" * (protocol.MAX_HEADER_BYTES + 1)])
    assert info.value.code == ErrorCode.TOO_LARGE


def test_an_oversized_payload_frame_is_refused():
    big = memoryview(bytearray(protocol.MAX_PAYLOAD_BYTES + 1))
    with pytest.raises(ProtocolError, match="payload frame") as info:
        protocol.decode([protocol.encode("commit_file", 1)[0], big])
    assert info.value.code == ErrorCode.TOO_LARGE


def nested_tuple(depth: int) -> bytes:
    value = 0
    for _ in range(depth):
        value = (value,)
    return protocol.pack_value(value)


def test_tuples_nest_up_to_the_limit_and_no_deeper():
    assert protocol.unpack_value(nested_tuple(protocol.MAX_TUPLE_NESTING)) is not None
    with pytest.raises(ValueError, match="nested deeper"):
        protocol.unpack_value(nested_tuple(protocol.MAX_TUPLE_NESTING + 1))
    # the depth count is per call: a refused value leaves none behind for the next one
    assert protocol.unpack_value(nested_tuple(protocol.MAX_TUPLE_NESTING)) is not None


def test_unknown_extension_types_and_short_tensor_refs_are_refused():
    import msgpack

    with pytest.raises(ValueError, match="unknown msgpack extension type 9"):
        protocol.unpack_value(msgpack.packb(msgpack.ExtType(9, b"")))
    with pytest.raises(ValueError, match="8 bytes, not 3"):
        protocol.unpack_value(msgpack.packb(msgpack.ExtType(1, b"abc")))


def test_values_that_are_not_plain_data_cannot_be_sent():
    with pytest.raises(TypeError, match="cannot encode a value of type object"):
        protocol.pack_value({"x": object()})


def test_fill_skeleton_puts_each_tensor_where_its_reference_was():
    skeleton = {"a": TensorRef(1), "b": [TensorRef(0), (TensorRef(1), 5)], "c": "text"}
    assert protocol.fill_skeleton(skeleton, ["t0", "t1"]) == {
        "a": "t1", "b": ["t0", ("t1", 5)], "c": "text"}


def test_a_ready_made_tensor_ref_packs_as_the_tensor_ref_itself():
    """flatten puts packed_tensor_ref(i) in its skeletons: the bytes must not change."""
    value = {"a": [protocol.packed_tensor_ref(2), (protocol.packed_tensor_ref(0), 1)]}
    same = {"a": [TensorRef(2), (TensorRef(0), 1)]}
    assert protocol.pack_value(value) == protocol.pack_value(same)
    assert protocol.unpack_value(protocol.pack_value(value)) == same
    assert protocol.packed_tensor_ref(2) is protocol.packed_tensor_ref(2)


def test_packed_tensor_refs_grown_by_many_threads_at_once_each_name_their_own_position(monkeypatch):
    """Trainer threads flatten state dicts concurrently. A reference stored at the wrong
    position would point a skeleton at another tensor, and that checkpoint would load the
    wrong data with every checksum passing."""
    import sys
    import threading

    from ckptd.protocol import framing

    monkeypatch.setattr(framing, "_PACKED_REFS", {})
    start = threading.Barrier(8)
    count = 3000

    def grow():
        start.wait()
        for index in range(count):
            framing.packed_tensor_ref(index)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=grow) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert len(framing._PACKED_REFS) == count
    wrong = [position for position, ref in framing._PACKED_REFS.items()
             if protocol.unpack_value(protocol.pack_value(ref)) != TensorRef(position)]
    assert wrong == []
