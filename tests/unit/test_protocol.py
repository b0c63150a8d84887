"""The wire contract: framing, validation, layout, endpoint discovery."""

import os

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


def test_layout_aligns_every_buffer_and_the_extent():
    offsets, total = protocol.layout_extent([10, 100, 0, 5])
    assert all(o % protocol.TENSOR_ALIGNMENT == 0 for o in offsets)
    assert offsets == sorted(offsets) and offsets[1] >= 10 and offsets[3] >= offsets[1] + 100
    assert total % protocol.EXTENT_ALIGNMENT == 0 and total >= offsets[-1] + 5


def test_socket_path_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv(protocol.SOCKET_ENV, str(tmp_path / "env.sock"))
    assert protocol.resolve_socket_path(tmp_path / "arg.sock") == str(tmp_path / "arg.sock")
    assert protocol.resolve_socket_path() == str(tmp_path / "env.sock")
    monkeypatch.delenv(protocol.SOCKET_ENV)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert protocol.resolve_socket_path() == str(tmp_path / "ckptd" / "ckptd.sock")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert protocol.resolve_socket_path() == f"/tmp/ckptd-{os.getuid()}/ckptd.sock"


def test_too_long_socket_path_gets_a_clear_error(tmp_path):
    with pytest.raises(ProtocolError, match="unix sockets allow"):
        protocol.endpoint_for("/" + "x" * 200)


def test_private_dir_is_closed_to_others(tmp_path):
    path = tmp_path / "run"
    path.mkdir(mode=0o755)
    os.chmod(path, 0o755)
    protocol.ensure_private_dir(str(path))
    assert os.stat(path).st_mode & 0o777 == 0o700


# ------------------------------------------------------------------ typed bodies and shared rules

def test_a_stage_body_is_checked_field_by_field_and_as_a_whole():
    good = {"format": "dcp", "path": "/ckpt/s", "buffers": [["float32", [2, 2], 16]],
            "files": [["__0_0.distcp", [0]]]}
    stage = protocol.Stage.from_wire(good)
    assert stage.files == [["__0_0.distcp", [0]]] and stage.cuda is None
    for field, bad in (("buffers", [["float32", [2], -1]]), ("buffers", [["object", [1], 8]]),
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


def test_unknown_fields_are_ignored_so_a_newer_client_can_add_optional_ones():
    assert protocol.Hello.from_wire({"rank": 1, "pid": 2, "new_field": 3}).rank == 1


def test_holders_follow_the_owner_in_clique_order():
    assert protocol.holder_order([4, 5, 6, 7], 6) == [7, 4, 5]
    assert protocol.holder_order([3], 3) == []


@pytest.mark.parametrize("session", ["", "job-42", "a.b_c"])
def test_plain_session_ids_are_accepted(session):
    assert protocol.check_session_id(session) == session


@pytest.mark.parametrize("session", ["..", ".", "a/b", "x" * 129, "sp ace", 7])
def test_unsafe_session_ids_are_refused(session):
    with pytest.raises(ValueError, match="not a plain name"):
        protocol.check_session_id(session)


def test_process_alive_sees_this_process_and_not_a_reaped_one():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert protocol.process_alive(os.getpid()) and not protocol.process_alive(child.pid)
