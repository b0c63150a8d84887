"""TorchAsyncCheckpoint through the real daemon: files torch.load reads, snapshot semantics."""

import os

import pytest
import torch

from ckpt_client import AsyncCallsQueue, TorchAsyncCheckpoint, async_torch_save, connect
from ckpt_client.errors import DaemonRequestError
from ckptd.checksum import verify_file
from conftest import wait_for
from states import assert_same
from multirank import run_ranks, values


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 128, generator=g), "b": torch.randn(128, generator=g),
                  "h": torch.randn(64, generator=g).to(torch.bfloat16),
                  "mask": torch.rand(32, generator=g) > 0.5},
        "step": seed, "ids": torch.arange(10), "strided": torch.randn(8, 8, generator=g).t(),
        "empty": torch.empty(0, 3), "meta": {"name": "run", "betas": (0.9, 0.95)},
    }


def test_saved_file_loads_with_weights_only_and_carries_a_checksum(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "step1", "model.pt")
    state = make_state(1)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(state, path)
    checkpoint.finalize_async_save(blocking=True)
    assert_same(torch.load(path, weights_only=True), state)
    assert verify_file(path).size == os.path.getsize(path)
    assert not [n for n in os.listdir(os.path.dirname(path)) if "ckptd-tmp" in n]
    checkpoint.close()


def test_changing_tensors_after_save_returns_does_not_change_the_checkpoint(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "snap.pt")
    state = make_state(2)
    expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    expected["model"] = {k: v.clone() for k, v in state["model"].items()}
    queue = AsyncCallsQueue()
    queue.schedule_async_request(async_torch_save(state, path))
    # The save returned: the tensors are staged. Train on, in place.
    state["model"]["w"].mul_(-1)
    state["model"]["b"].zero_()
    state["ids"].add_(100)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert_same(torch.load(path, weights_only=True), expected)


def test_several_saves_in_flight_finalize_in_order(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    queue = AsyncCallsQueue()
    states = [make_state(i) for i in range(4)]
    paths = [os.path.join(daemon.roots[0], f"it{i}.pt") for i in range(4)]
    finalized = []
    for i, (state, path) in enumerate(zip(states, paths)):
        request = async_torch_save(state, path)
        request.add_finalize_fn(lambda i=i: finalized.append(i))
        queue.schedule_async_request(request)
    assert queue.maybe_finalize_async_calls(blocking=True, no_dist=True) == [0, 1, 2, 3]
    assert finalized == [0, 1, 2, 3]
    for state, path in zip(states, paths):
        assert_same(torch.load(path, weights_only=True), state)
    doc = daemon.status()
    assert doc["pool"]["used_bytes"] == 0 and doc["totals"]["saves_done"] == 4


def test_a_save_larger_than_the_pool_is_refused_clearly(start_daemon, monkeypatch):
    small = start_daemon(pool_size="4M")
    monkeypatch.setenv("CKPTD_SOCKET", small.socket)
    with pytest.raises(DaemonRequestError, match="--pool-size") as info:
        async_torch_save({"big": torch.zeros(2 << 20)}, os.path.join(small.roots[0], "big.pt"))
    assert info.value.code == "pool_too_small"
    assert small.status()["requests"] == []


def rank_saves_and_finalizes(rank, world_size, root):
    state = make_state(100 + rank)
    checkpoint = TorchAsyncCheckpoint()
    path = os.path.join(root, f"rank{rank}.pt")
    checkpoint.async_save(state, path)
    state["model"]["w"].add_(1.0)  # training goes on right away
    checkpoint.finalize_async_save(blocking=True, no_dist=False)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"] + 1.0, state["model"]["w"])
    return connect().rank


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rank_saves_its_own_file(daemon, tmp_path, world_size):
    ranks = values(run_ranks(rank_saves_and_finalizes, world_size, daemon.socket, tmp_path,
                             args=(daemon.roots[0],)))
    assert ranks == list(range(world_size))
    for rank in range(world_size):
        assert_same(torch.load(os.path.join(daemon.roots[0], f"rank{rank}.pt"),
                               weights_only=True)["meta"], make_state(0)["meta"])


def rank_saves_to_a_shared_path(rank, world_size, path):
    checkpoint = TorchAsyncCheckpoint()
    for _ in range(3):
        checkpoint.async_save({"who": torch.full((1 << 18,), float(rank))}, path)
    checkpoint.finalize_async_save(blocking=True, no_dist=False)
    return True


def test_concurrent_saves_to_one_path_never_mix_bytes(start_daemon, tmp_path):
    daemon = start_daemon(writers=2)
    path = os.path.join(daemon.roots[0], "latest.pt")
    values(run_ranks(rank_saves_to_a_shared_path, 2, daemon.socket, tmp_path, args=(path,)))
    verify_file(path)
    who = torch.load(path, weights_only=True)["who"]
    assert torch.equal(who, torch.full_like(who, who[0].item())) and who[0].item() in (0.0, 1.0)
    assert [n for n in os.listdir(daemon.roots[0]) if "ckptd-tmp" in n] == []


def test_a_default_save_does_not_wait_for_staged_and_its_first_poll_reads_the_reply(
        daemon, monkeypatch):
    """A default save the trainer copied whole returns once its bytes are in the pool,
    without waiting for the STAGED reply (one round trip less in the blocking call); the
    save's first poll reads that reply, so nothing stays kept on the channel."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    connection = connect()
    path = os.path.join(daemon.roots[0], "unconfirmed.pt")
    state = make_state(5)
    request = async_torch_save(state, path, connection)
    (save,) = request.daemon_saves
    assert save.staged_reply is not None
    queue = AsyncCallsQueue()
    queue.schedule_async_request(request)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert save.staged_reply is None
    assert not connection.channel._awaited and not connection.channel._arrived
    assert_same(torch.load(path, weights_only=True), state)


def test_a_save_the_daemon_failed_before_its_unconfirmed_staged_fails_at_finalize(
        start_daemon, monkeypatch):
    """The trainer's copy outlasts the daemon's staging deadline: the daemon fails the save
    and refuses its STAGED. The call returned without that reply, so the failure must come
    out of finalize, naming the deadline; nothing is written; the next save succeeds."""
    from conftest import wait_for
    from ckpt_client import CheckpointException
    from ckpt_client.transport.pool_copy import PoolCopier

    daemon = start_daemon(env={"CKPTD_STAGING_DEADLINE": "0.5"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "late.pt")
    real_copy = PoolCopier.copy

    def copy_after_the_deadline(self, *args, **kwargs):
        wait_for(lambda: [r for r in daemon.status()["requests"]
                          if r["path"] == path and r["phase"] == "failed"], 30,
                 "the daemon to fail the save by its staging deadline")
        return real_copy(self, *args, **kwargs)

    monkeypatch.setattr(PoolCopier, "copy", copy_after_the_deadline)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save(make_state(6), path)
    monkeypatch.setattr(PoolCopier, "copy", real_copy)
    with pytest.raises(CheckpointException, match="CKPTD_STAGING_DEADLINE"):
        checkpoint.finalize_async_save(blocking=True)
    assert not os.path.exists(path)
    checkpoint.async_save(make_state(7), path)
    checkpoint.finalize_async_save(blocking=True)
    assert_same(torch.load(path, weights_only=True), make_state(7))
    checkpoint.close()


def record_sends_ahead(monkeypatch) -> list:
    """Per torch save from now on: whether its STAGE was sent ahead of the walk."""
    from ckpt_client.transport import sent_ahead

    sent = []
    real_send = sent_ahead.SentAhead.send.__func__

    def spy(cls, *args):
        ahead = real_send(cls, *args)
        sent.append(ahead is not None)
        return ahead

    monkeypatch.setattr(sent_ahead.SentAhead, "send", classmethod(spy))
    return sent


def test_a_save_of_a_steady_layout_sends_its_stage_ahead_and_its_skeleton_with_staged(
        daemon, monkeypatch):
    """Once two saves of one kind (top-level keys) had the same layout, the next sends its
    STAGE before the state dict is walked and its skeleton, whose plain values changed,
    with STAGED: the file has the new values. A changed layout drops the request sent
    ahead (aborted, forgotten, nothing written), and so does a state dict that cannot be
    saved; layouts that alternate within one kind are never sent ahead; every file is
    right and the pool ends empty."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    used = record_sends_ahead(monkeypatch)
    root = daemon.roots[0]
    checkpoint = TorchAsyncCheckpoint()

    def reshaped(seed: int) -> dict:
        state = make_state(seed)
        state["model"]["w"] = torch.randn(3, 3)
        return state

    saved = {}
    plan = [("a0", make_state(10)), ("a1", make_state(11)), ("a2", make_state(12)),
            ("r0", reshaped(13)), ("a3", make_state(14)), ("a4", make_state(15))]
    for name, state in plan:
        checkpoint.async_save(state, os.path.join(root, f"{name}.pt"))
        saved[name] = state
    bad = make_state(16)
    bad["meta"]["x"] = object()
    with pytest.raises(TypeError, match=r"state_dict\.meta\.x"):
        checkpoint.async_save(bad, os.path.join(root, "bad.pt"))
    for i in range(4):  # alternating within one kind: never guessed
        name, state = (f"alt{i}", reshaped(20 + i) if i % 2 else make_state(20 + i))
        checkpoint.async_save(state, os.path.join(root, f"{name}.pt"))
        saved[name] = state
    checkpoint.finalize_async_save(blocking=True)
    assert used == [False, False, True, True, False, False, True, False, False, False, False]
    for name, state in saved.items():
        loaded = torch.load(os.path.join(root, f"{name}.pt"), weights_only=True)
        assert loaded["step"] == state["step"]
        assert_same(loaded, state)
    assert sorted(n for n in os.listdir(root) if n.endswith(".pt")) == \
        sorted(f"{name}.pt" for name in saved)
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "every extent freed")
    assert [r for r in daemon.status()["requests"] if r["phase"] not in ("done", "aborted")] == []
    checkpoint.close()


def record_stages(monkeypatch) -> list:
    """Per STAGE sent from now on: (the request id whose layout it names, its buffer count)."""
    from ckptd.protocol import MessageType
    from ckpt_client.transport.connection import DaemonConnection

    stages = []
    real_send = DaemonConnection.send

    def spy(self, msg_type, body=None, frames=()):
        if msg_type == MessageType.STAGE:
            stages.append((body.layout_of, len(body.buffers)))
        return real_send(self, msg_type, body, frames)

    monkeypatch.setattr(DaemonConnection, "send", spy)
    return stages


@pytest.mark.parametrize("kept", ["8", "0"])
def test_a_stage_sent_ahead_names_the_last_saves_layout_or_sends_the_buffers_when_not_kept(
        start_daemon, monkeypatch, kept):
    """The STAGE sent ahead names the request of the save before instead of repeating its
    buffers (the daemon keeps the layouts of each connection's last torch saves). A
    daemon that keeps none (``CKPTD_SENT_AHEAD_KINDS=0`` in its environment only) refuses
    the name as unknown, and the save sends its buffers and skeleton instead. Either way
    every file is right and nothing stays held; a layout nobody saved is refused."""
    from ckptd.protocol import ErrorCode, MessageType, SaveFormat, Stage
    from ckpt_client.transport.flatten import flatten_state_dict

    daemon = start_daemon(env={"CKPTD_SENT_AHEAD_KINDS": kept})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root = daemon.roots[0]
    checkpoint = TorchAsyncCheckpoint()
    for seed in range(40, 44):
        checkpoint.async_save(make_state(seed), os.path.join(root, f"k{seed}.pt"))
    checkpoint.finalize_async_save(blocking=True)
    buffers = len(flatten_state_dict(make_state(0)).tensors)
    named = [(layout_of, 0) for layout_of, count in stages if layout_of is not None]
    assert len(named) == 2 and all(isinstance(n[0], int) for n in named)
    expected = [(None, buffers)] * 2 + ([named[0], named[1]] if kept != "0" else
                                        [named[0], (None, buffers), named[1], (None, buffers)])
    assert stages == expected
    for seed in range(40, 44):
        assert_same(torch.load(os.path.join(root, f"k{seed}.pt"), weights_only=True),
                    make_state(seed))
    with pytest.raises(DaemonRequestError, match="not kept") as info:
        connect(daemon.socket).call(MessageType.STAGE, Stage(
            format=SaveFormat.TORCH, path=os.path.join(root, "x.pt"), buffers=[],
            layout_of=10**6), timeout=30)
    assert info.value.code == ErrorCode.LAYOUT_UNKNOWN
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "every extent freed")
    assert [r for r in daemon.status()["requests"] if r["phase"] not in ("done", "aborted")] == []
    checkpoint.close()


def test_a_save_sent_ahead_that_fails_before_it_is_staged_leaves_nothing_held(
        daemon, monkeypatch):
    """The third save of a steady layout sends its STAGE ahead; a tensor of a dtype ckptd
    cannot store, nested where the kind (top-level keys) does not see it, fails the save
    only once the walk is done. The error reaches the caller, the request sent ahead is
    aborted (no extent held until its staging deadline, no unread reply), and the next
    save works."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    sent = record_sends_ahead(monkeypatch)
    root = daemon.roots[0]
    checkpoint = TorchAsyncCheckpoint()
    for seed in (30, 31):
        checkpoint.async_save(make_state(seed), os.path.join(root, f"s{seed}.pt"))
    odd = make_state(32)
    odd["model"]["odd"] = torch.zeros(4, dtype=torch.float8_e5m2fnuz)
    with pytest.raises(TypeError, match="float8_e5m2fnuz"):
        checkpoint.async_save(odd, os.path.join(root, "odd.pt"))
    assert sent == [False, False, True]
    checkpoint.finalize_async_save(blocking=True)
    assert [r for r in daemon.status()["requests"] if r["phase"] not in ("done", "aborted")] == []
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "every extent freed")
    path = os.path.join(root, "after.pt")
    checkpoint.async_save(make_state(33), path)
    checkpoint.finalize_async_save(blocking=True)
    assert_same(torch.load(path, weights_only=True), make_state(33))
    assert not os.path.exists(os.path.join(root, "odd.pt"))
    checkpoint.close()


def test_a_torch_save_whose_stage_and_staged_carry_no_skeleton_is_refused_at_staged(daemon):
    """The daemon refuses it (BAD_REQUEST, naming the missing skeleton) when STAGED comes,
    ends it and frees its extent, instead of a writer failing on an empty skeleton."""
    from ckptd.protocol import ErrorCode, MessageType, SaveFormat, Stage, Staged

    connection = connect(daemon.socket)
    path = os.path.join(daemon.roots[0], "no_skeleton.pt")
    reply = connection.call(MessageType.STAGE, Stage(
        format=SaveFormat.TORCH, path=path, buffers=[["float32", [4], 16]]), timeout=30)
    with pytest.raises(DaemonRequestError, match="torch save with no skeleton") as info:
        connection.call(MessageType.STAGED, Staged(request_id=reply.request_id), timeout=30)
    assert info.value.code == ErrorCode.BAD_REQUEST
    (state,) = [r for r in daemon.status()["requests"] if r["id"] == reply.request_id]
    assert state["phase"] == "failed"
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "its extent freed")
    assert not os.path.exists(path)
    connection.close()
