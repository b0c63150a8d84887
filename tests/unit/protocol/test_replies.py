"""The client channel's reply bodies: one per request type, round trips, refusals that
name the field, nested entries, and unknown keys ignored (a newer daemon may add some)."""

from __future__ import annotations

import dataclasses

import pytest

from ckptd import protocol
from ckptd.protocol import (REPLIES, AbortReply, CommitFileReply, Empty, ErrorCode, ForgetReply,
                            HandoverReply, HeldPart, HelloReply, LocalCommitReply, LocalFetchReply,
                            LocalInventoryReply, LocalSessionReply, MessageType, PeerInfoReply,
                            PingReply, PollReply, ProtocolError, RequestState, StagedReply,
                            StageReply, TraceSpansReply, WrittenFile, reply_type_for)

PART = HeldPart(iteration=4, owner=1, size=4096, verified=True, committed=False,
                path="/local/s/iter_4/rank_1.part", identity=[4096, 17, 99],
                resident={"items": [[0, 64]], "crc": 5, "size": 4096})

#: One filled-in body of every reply type (every field away from its default).
SAMPLES = [
    HelloReply(daemon_pid=10, incarnation="abc", version="0.1", pool_path="/dev/shm/p",
               pool_size=1 << 20, writers=4, host="node1", cuda=True, cuda_devices=["GPU-1"],
               tiered=True),
    StageReply(request_id=3, offset=4096, length=128, phase="staging",
               placements={"__0_0.distcp": [[0, 64], [64, 64]]}),
    StagedReply(request_id=3, phase="writing", ipc_kept=[0, 2]),
    PollReply(requests={3: RequestState(
        phase="done", bytes_total=128, bytes_written=128, error=None,
        errors=[{"rank": 0, "path": "/c", "errno": None, "message": "rank 0: x"}],
        transport_bytes={"shm": 64, "cuda": 64},
        written=[WrittenFile(name="__0_0.distcp", path="/c/__0_0.distcp", size=128, crc32=7, algorithm="crc32c",
                             items=[[0, 64], [64, 64]], file_id=[1, 2],
                             timing={"writer": 0, "started_at": 1.0, "synced_at": 2.0,
                                     "ended_at": 2.5})],
        stale_of="/c/previous",
        replication={"wanted": 1, "reduced_redundancy": False, "holders": {}},
        flush={"attempt": 2, "next_retry_at": None, "bytes_done": 64, "bytes_total": 128,
               "target": "/c", "last_error": "EIO"}),
        4: RequestState(phase="unknown", error="gone")}),
    ForgetReply(forgotten=[3]),
    AbortReply(aborted=[5, 6]),
    CommitFileReply(path="/c/.metadata", size=12),
    HandoverReply(path="/c/.metadata", files=3),
    PingReply(pid=10),
    PeerInfoReply(address="tcp://10.0.0.1:7000", public_key="k" * 40,
                  bulk_address="10.0.0.1:7001", encryption="aes-256-gcm", local_dir="/local",
                  host="node1", network="boot/netns:1", pid=10),
    LocalSessionReply(directory="/local/s", address=None),
    LocalInventoryReply(address="tcp://10.0.0.1:7000", host="node1", parts=[PART]),
    LocalFetchReply(path="/local/s/iter_4/rank_1.part", holder="tcp://10.0.0.2:7000",
                    tried=[{"holder": "tcp://10.0.0.3:7000", "error": "refused"}],
                    moved_aside="/local/s/iter_4/rank_1.part.corrupt", identity=[1, 2, 3]),
    LocalCommitReply(removed=[1, 2]),
    TraceSpansReply(kept=True),
]


def sample(body_type: type):
    return next(s for s in SAMPLES if type(s) is body_type)


def test_every_request_type_has_a_declared_reply():
    requests = {v for k, v in vars(MessageType).items()
                if not k.startswith("_") and v not in (MessageType.REPLY, MessageType.ERROR)}
    assert set(REPLIES) == requests
    assert REPLIES[MessageType.STATUS] is dict  # the status document keeps its own schema
    assert REPLIES[MessageType.TRACE] is dict  # so does the Chrome trace document
    assert reply_type_for(MessageType.GOODBYE) is Empty
    with pytest.raises(KeyError, match="no reply body is declared for 'frobnicate'"):
        reply_type_for("frobnicate")


def test_every_reply_body_has_a_sample_here():
    declared = {t for t in REPLIES.values() if t not in (dict, Empty)}
    assert declared == {type(s) for s in SAMPLES}


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: type(b).__name__)
def test_a_reply_round_trips_through_the_real_framing(body):
    """Encoded and decoded as the endpoint and the channel do (msgpack, int map keys)."""
    message = protocol.decode(protocol.encode(MessageType.REPLY, 1, body.to_wire()))
    assert type(body).from_wire(message.body) == body


def test_nested_entries_become_bodies_on_receipt_and_maps_on_sending():
    wire = sample(PollReply).to_wire()
    assert isinstance(wire["requests"][3], dict) and isinstance(wire["requests"][3]["written"][0],
                                                                dict)
    poll = PollReply.from_wire(wire)
    assert isinstance(poll.requests[3].written[0], WrittenFile)
    assert poll.requests[3].written[0].name == "__0_0.distcp"
    inventory = LocalInventoryReply.from_wire(sample(LocalInventoryReply).to_wire())
    assert inventory.parts == [PART]


@pytest.mark.parametrize("body", SAMPLES, ids=lambda b: type(b).__name__)
def test_a_missing_required_field_is_refused_naming_it(body):
    required = [f.name for f in dataclasses.fields(body)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    assert required, "every reply carries something the client needs"
    for name in required:
        wire = body.to_wire()
        del wire[name]
        with pytest.raises(ProtocolError, match=f"{type(body).__name__} needs '{name}'") as info:
            type(body).from_wire(wire)
        assert info.value.code == ErrorCode.BAD_REQUEST and "same ckptd version" in info.value.hint


def test_a_renamed_field_fails_at_both_ends():
    with pytest.raises(TypeError, match="ofset"):  # the daemon cannot build it
        StageReply(request_id=1, ofset=0, length=1, phase="staging")
    wire = {"request_id": 1, "ofset": 0, "length": 1, "phase": "staging"}
    with pytest.raises(ProtocolError, match="StageReply needs 'offset'"):  # nor read it
        StageReply.from_wire(wire)


@pytest.mark.parametrize("wire, complaint", [
    ({"requests": {3: {"bytes_total": 1}}}, r"PollReply.requests\[3\]: RequestState needs 'phase'"),
    ({"requests": {3: {"phase": "done", "written": [{"path": "/c", "size": 1}]}}},
     r"PollReply.requests\[3\]: RequestState.written\[0\]: WrittenFile needs 'name'"),
    ({"requests": {3: {"phase": 7}}}, r"RequestState: 'phase' = 7"),
    ({"requests": {3: "done"}}, r"PollReply: 'requests'"),
    ({"requests": {"3": {"phase": "done"}}}, r"PollReply: 'requests'"),  # keys are request ids
    ({"requests": [{"phase": "done"}]}, r"PollReply: 'requests'"),
])
def test_a_bad_nested_entry_is_refused_naming_where_it_is(wire, complaint):
    with pytest.raises(ProtocolError, match=complaint):
        PollReply.from_wire(wire)


def test_a_field_of_the_wrong_type_is_refused_naming_it():
    wire = {**sample(HelloReply).to_wire(), "pool_size": "1G"}
    with pytest.raises(ProtocolError, match="HelloReply: 'pool_size' = '1G'"):
        HelloReply.from_wire(wire)


def test_unknown_keys_are_ignored_so_a_newer_daemon_can_add_optional_fields():
    wire = sample(PollReply).to_wire()
    wire["newer_field"] = {"anything": 1}
    wire["requests"][3]["deadline_s"] = 12.5
    wire["requests"][3]["written"][0]["tier"] = "nvme"
    assert PollReply.from_wire(wire) == sample(PollReply)  # read, and the extra keys dropped
    assert "newer_field" not in PollReply.from_wire(wire).to_wire()


def test_an_older_daemon_without_an_optional_field_is_still_read():
    wire = sample(HelloReply).to_wire()
    for optional in ("writers", "host", "cuda", "cuda_devices", "tiered"):
        del wire[optional]
    hello = HelloReply.from_wire(wire)
    assert (hello.writers, hello.host, hello.cuda, hello.cuda_devices, hello.tiered) == \
        (1, None, False, [], False)
