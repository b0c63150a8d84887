"""A blocking DCP save's guessed copy sends its STAGE before it looks its items up, naming
the layout of the last guessed save instead of sending a thousand buffer descriptions.

Real daemons, one trainer process. The STAGE is watched where it leaves the trainer
(``DaemonConnection.send``): which layout it names, how many buffers it carries and which
thread sent it (a STAGE that went ahead leaves from the calling thread; the ordinary one
from the connection's staging thread, once the items are looked up). Every checkpoint
must load through stock ``dcp.load`` with its own call's values, whichever way its STAGE
went, and nothing may stay held in the daemon.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import FileSystemReader

from conftest import wait_for
from test_dcp_guessed_copy import assert_loads, requests_for, save
from ckpt_client import AsyncCallsQueue, dcp
from ckpt_client.errors import DaemonRequestError
from ckpt_client.transport.connection import DaemonConnection, connect
from ckptd.protocol import ErrorCode, MessageType, SaveFormat, Stage


def state_at(step: int, note: str = "steady") -> dict:
    """A training state whose values change every step and whose pickled non-tensor
    leaves keep their sizes (``note`` aside)."""
    gen = torch.Generator().manual_seed(step)
    return {"model": {f"layer{i}.weight": torch.randn(32, 16, generator=gen)
                      for i in range(6)},
            "optim": {"step": step, "lr": 0.1 / (step + 1), "note": note,
                      "moments": [torch.randn(16, generator=gen) for _ in range(3)]}}


def record_stages(monkeypatch) -> list:
    """Per STAGE sent from now on: (layout it names, buffers it carries, sent by the
    calling thread)."""
    stages, real_send = [], DaemonConnection.send

    def spy(self, msg_type, body=None, frames=()):
        if msg_type == MessageType.STAGE:
            stages.append((body.layout_of, len(body.buffers),
                           threading.current_thread() is threading.main_thread()))
        return real_send(self, msg_type, body, frames)

    monkeypatch.setattr(DaemonConnection, "send", spy)
    return stages


@pytest.fixture(autouse=True)
def fresh_guesses(monkeypatch):
    """Each test starts with no remembered plan (they are kept per process)."""
    from ckpt_client.dcp import guessed_plan

    monkeypatch.setattr(guessed_plan, "_remembered", {})
    monkeypatch.setattr(guessed_plan, "_never", set())


def assert_nothing_held(daemon) -> None:
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "every extent freed")
    assert [r for r in daemon.status()["requests"] if r["phase"] not in ("done", "aborted")] == []


BUFFERS = 6 + 3 + 3  # tensors, then the step, lr and note leaves


def test_a_guessed_copy_names_the_last_guessed_layout_before_its_lookups(daemon, monkeypatch):
    """Save 1 plans first and stages on the calling thread; save 2 is the first guess (its
    descriptions are made then, so its STAGE carries them, from the staging thread after
    the lookups); save 3 finds them as they were (the kind is steady, as a torch save's
    layout once two saves had it), so from save 4 on the STAGE leaves the calling
    thread before the lookups and names the request of the save before."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step in range(1, 6):
        save(queue, state_at(step), os.path.join(root, f"s{step}"))
    assert stages[:3] == [(None, BUFFERS, True)] + [(None, BUFFERS, False)] * 2, stages
    named = stages[3:]
    assert [(n[1], n[2]) for n in named] == [(0, True)] * 2, stages
    assert all(isinstance(n[0], int) for n in named) and named[0][0] < named[1][0]
    for step in range(1, 6):
        assert_loads(os.path.join(root, f"s{step}"), state_at(step))
    assert_nothing_held(daemon)
    queue.close()


def kind_state(kind: str, step: int) -> dict:
    """A state dict of kind ``kind`` (its top-level keys), values changing every step."""
    gen = torch.Generator().manual_seed(step)
    return {kind: {f"w{i}": torch.randn(16, generator=gen) for i in range(4)}, "step": step}


def test_each_of_several_kinds_saved_in_turn_names_its_own_kept_layout(daemon, monkeypatch):
    """A trainer saves three kinds of DCP state dict in turn (model, optimizer, ...): each
    guess names the request of the last save of its own kind, three saves back, and the
    daemon still keeps it (none refused as unknown, which would send the buffers again
    from the staging thread)."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    kinds = ["model", "optim", "sched"]
    for step in range(1, 6):
        for kind in kinds:
            save(queue, kind_state(kind, step), os.path.join(root, f"{kind}{step}"))
    # steps 1 to 3: planned first, the first guess (descriptions made then), steady
    assert [s[0] for s in stages[:9]] == [None] * 9, stages
    named = stages[9:]
    assert len(named) == 6 and all(isinstance(s[0], int) and s[1:] == (0, True)
                                   for s in named), stages
    for step in range(1, 6):
        for kind in kinds:
            expected = kind_state(kind, step)
            loaded = {kind: {k: torch.zeros_like(v) for k, v in expected[kind].items()},
                      "step": 0}
            DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, f"{kind}{step}")))
            assert loaded["step"] == step and all(
                torch.equal(loaded[kind][k], v) for k, v in expected[kind].items())
    assert_nothing_held(daemon)
    queue.close()


def saved_keeping_no_layouts(start_daemon, monkeypatch, saves: int) -> tuple:
    """``saves`` saves through a daemon that keeps no layouts (``CKPTD_SENT_AHEAD_KINDS=0``
    in its environment only): the daemon, the STAGEs recorded and the queue."""
    daemon = start_daemon(env={"CKPTD_SENT_AHEAD_KINDS": "0"})
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    queue = AsyncCallsQueue()
    for step in range(1, saves + 1):
        save(queue, state_at(step), os.path.join(daemon.roots[0], f"s{step}"))
    return daemon, stages, queue


def test_a_layout_the_daemon_no_longer_keeps_is_sent_whole(start_daemon, monkeypatch):
    """A daemon that keeps no layouts refuses the name as unknown; the staging thread
    sends the buffers then."""
    daemon, stages, queue = saved_keeping_no_layouts(start_daemon, monkeypatch, 5)
    root = daemon.roots[0]
    named = [s for s in stages if s[0] is not None]
    assert len(named) == 2 and all(s[1:] == (0, True) for s in named), stages
    assert stages[3:] == [named[0], (None, BUFFERS, False), named[1], (None, BUFFERS, False)]
    for step in range(1, 6):
        assert_loads(os.path.join(root, f"s{step}"), state_at(step))
    assert_nothing_held(daemon)
    queue.close()


def test_a_save_dropped_while_its_named_layout_is_refused_sends_no_stage_again(
        start_daemon, monkeypatch):
    """The save is dropped (its planning failed) while the reply to its STAGE sent ahead is
    on its way, and that reply refuses the layout it named as unknown: the staging job
    ends there, as it does for a save dropped before its STAGE went out, instead of
    sending the STAGE again with its buffers for the daemon to admit and abort."""
    from ckpt_client.dcp import save as save_mod
    from ckpt_client.transport import handover as handover_mod

    daemon, stages, queue = saved_keeping_no_layouts(start_daemon, monkeypatch, 4)
    root = daemon.roots[0]
    entered, dropped = threading.Event(), threading.Event()
    real_reply = handover_mod.stage_reply

    def held_reply(connection, msg_id):  # the staging job, past its own dropped check
        entered.set()
        assert dropped.wait(60), "the save was never dropped"
        return real_reply(connection, msg_id)

    def failed_planning(*args, **kwargs):
        assert entered.wait(60), "the staging job never waited for its STAGE's reply"
        raise RuntimeError("planning failed")

    monkeypatch.setattr(handover_mod, "stage_reply", held_reply)
    monkeypatch.setattr(save_mod, "global_plan", failed_planning)
    sent = len(stages)
    with pytest.raises(RuntimeError, match="planning failed"):
        dcp.async_save(state_at(5), os.path.join(root, "bad"))
    dropped.set()
    handover_mod.handover_for(connect(daemon.socket)).wait_for_background()
    assert len(stages) == sent + 1 and stages[-1][1:] == (0, True), stages
    assert requests_for(daemon, os.path.join(root, "bad")) == []
    assert_nothing_held(daemon)
    queue.close()


def test_a_leaf_that_changes_size_drops_the_stage_sent_ahead(daemon, monkeypatch):
    """A non-tensor leaf whose pickled size changes makes other descriptions than those
    the STAGE sent ahead with: that request is dropped unwritten, the copy is staged
    with the new ones, and the checkpoint holds the new value."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step in range(1, 5):
        save(queue, state_at(step), os.path.join(root, f"s{step}"))
    assert stages[-1][1:] == (0, True)
    grown = state_at(5, note="a longer note than before " * 200)
    save(queue, grown, os.path.join(root, "s5"))
    assert stages[-2][1:] == (0, True) and stages[-1] == (None, BUFFERS, False), stages
    assert_loads(os.path.join(root, "s5"), grown)
    assert sorted(os.listdir(root)) == [f"s{step}" for step in range(1, 6)]
    assert_nothing_held(daemon)
    queue.close()


@pytest.mark.parametrize("note", [lambda step: "x" * (10 if step % 2 else 5000),
                                  lambda step: "x" * 100 * step], ids=["alternating", "growing"])
def test_a_leaf_changing_size_every_save_sends_no_stage_ahead(daemon, monkeypatch, note):
    """A non-tensor leaf whose pickled size changes from save to save (a note alternating,
    a growing history) makes each save's descriptions anew: no STAGE goes ahead with the
    last ones, so the daemon never admits a request only for it to be aborted (its extent
    reserved, write-ahead jobs sent). Once the sizes hold for a save, the next one sends
    its STAGE ahead again."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    states = [state_at(step, note=note(step)) for step in range(1, 9)]
    states += [state_at(step) for step in range(9, 12)]
    for step, state in enumerate(states, start=1):
        save(queue, state, os.path.join(root, f"s{step}"))
    assert [r["phase"] for r in daemon.status()["requests"]] == ["done"] * len(states)
    assert [s[0] for s in stages[:10]] == [None] * 10, stages
    assert stages[10][1:] == (0, True), stages  # saves 9 and 10 had one layout
    for step, state in enumerate(states, start=1):
        assert_loads(os.path.join(root, f"s{step}"), state)
    assert_nothing_held(daemon)
    queue.close()


def test_a_guess_never_names_a_layout_of_another_daemon(start_daemon, monkeypatch):
    """The trainer moves to another daemon (another socket, as after a restart): the
    layout it kept is that of a request of the first daemon, so its first STAGE there
    (still sent ahead of the lookups) carries the buffers."""
    first, second = start_daemon(), start_daemon()
    monkeypatch.setenv("CKPTD_SOCKET", first.socket)
    stages = record_stages(monkeypatch)
    queue = AsyncCallsQueue()
    for step in range(1, 5):
        save(queue, state_at(step), os.path.join(first.roots[0], f"s{step}"))
    assert stages[-1][1:] == (0, True)
    monkeypatch.setenv("CKPTD_SOCKET", second.socket)
    save(queue, state_at(5), os.path.join(second.roots[0], "s5"))
    assert stages[-1] == (None, BUFFERS, True), stages
    assert_loads(os.path.join(second.roots[0], "s5"), state_at(5))
    assert_nothing_held(second)
    queue.close()


def test_a_named_dcp_layout_checks_its_files_against_the_kept_buffers(daemon, monkeypatch):
    """The daemon checks a DCP STAGE's files against the buffers of the layout it names
    (they cannot be checked before): a file naming a buffer past them is refused, and a
    name the daemon never kept is refused as unknown."""
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step in range(1, 5):
        save(queue, state_at(step), os.path.join(root, f"s{step}"))
    kept = stages[-1][0]
    connection = connect(daemon.socket)
    body = Stage(format=SaveFormat.DCP, path=os.path.join(root, "bad"), buffers=[],
                 files=[["__0_x_0.distcp", [0, BUFFERS]]], layout_of=kept)
    with pytest.raises(DaemonRequestError, match=f"beyond the {BUFFERS} described") as info:
        connection.call(MessageType.STAGE, body, timeout=30)
    assert info.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(DaemonRequestError, match="not kept") as info:
        connection.call(MessageType.STAGE, Stage(
            format=SaveFormat.DCP, path=os.path.join(root, "bad"), buffers=[],
            files=[["__0_x_0.distcp", [0]]], layout_of=10**6), timeout=30)
    assert info.value.code == ErrorCode.LAYOUT_UNKNOWN
    assert not os.path.exists(os.path.join(root, "bad"))
    assert_nothing_held(daemon)
    queue.close()


def test_a_state_of_device_tensors_sends_no_stage_ahead(daemon, monkeypatch):
    """Where the lookup finds device tensors (the copy then goes after planning, by the
    CUDA route), later saves send no STAGE ahead: one would only be dropped again, each
    save. No GPU here: the lookup's host check is made to answer "device"."""
    from ckpt_client.dcp import guessed_plan

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    monkeypatch.setattr(guessed_plan, "_host_buffers", lambda sources: None)
    stages = record_stages(monkeypatch)
    root, queue = daemon.roots[0], AsyncCallsQueue()
    for step in range(1, 6):
        save(queue, state_at(step), os.path.join(root, f"s{step}"))
    assert stages == [(None, BUFFERS, True)] * 5  # each staged once, after its planning
    assert [r["phase"] for r in daemon.status()["requests"]] == ["done"] * 5
    for step in range(1, 6):
        assert_loads(os.path.join(root, f"s{step}"), state_at(step))
    queue.close()


def test_a_stage_sent_ahead_through_a_connection_given_up_is_not_waited_for(
        start_daemon, monkeypatch, tmp_path):
    """The trainer's connection changes between the STAGE sent ahead and the staging (the
    daemon replaced in that window): the save stages through the new connection, and the
    request sent ahead through the old one is dropped there, not waited for."""
    from ckpt_client.dcp import guessed_plan

    shared = str(tmp_path / "shared")
    os.makedirs(shared)
    first, second = start_daemon(roots=[shared]), start_daemon(roots=[shared])
    monkeypatch.setenv("CKPTD_SOCKET", first.socket)
    stages = record_stages(monkeypatch)
    queue = AsyncCallsQueue()
    for step in range(1, 5):
        save(queue, state_at(step), os.path.join(shared, f"s{step}"))
    real_look_up = guessed_plan._look_up

    def moved_daemon(known, state_dict):
        os.environ["CKPTD_SOCKET"] = second.socket  # undone by monkeypatch.setenv's undo
        return real_look_up(known, state_dict)

    monkeypatch.setattr(guessed_plan, "_look_up", moved_daemon)
    save(queue, state_at(5), os.path.join(shared, "s5"))
    assert stages[-2][1:] == (0, True) and stages[-1][:2] == (None, BUFFERS), stages
    assert_loads(os.path.join(shared, "s5"), state_at(5))
    assert_nothing_held(first)
    assert [r["phase"] for r in first.status()["requests"]][-1] == "aborted"
    assert_nothing_held(second)
    queue.close()
