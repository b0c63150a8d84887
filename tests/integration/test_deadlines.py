"""Deadlines of a save, as the daemon enforces them and operators configure and see them.

The option and its knob: ``ckptd serve --stall-timeout SECONDS`` (env
``CKPTD_STALL_TIMEOUT``) is read, checked and shown in ``ckptd status``. Real faults: a
FUSE target whose writes stop answering (tests/faultfs.py), a writer process SIGSTOPped,
a rank SIGSTOPped before its staging copy (the staging deadline), a daemon SIGSTOPped.
Each: the deadline fires with rank, file and phase in the message on every rank, nothing
partial is visible, status showed the save stuck while it was, the next save succeeds.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as DCP
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader

from conftest import wait_for
from faultfs import FaultFS, fuse_unavailable
from faults import writers_paused
from multirank import collect, start_ranks, values
from ckpt_client import AsyncCallsQueue, CheckpointException, TorchAsyncCheckpoint, dcp

needs_fuse = pytest.mark.skipif(bool(fuse_unavailable()), reason=fuse_unavailable() or "-")


def test_stall_timeout_option_is_shown_in_status(start_daemon):
    daemon = start_daemon(extra_args=["--stall-timeout", "7.5"])
    assert daemon.status()["deadlines"]["stall_timeout_s"] == 7.5
    table = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", daemon.socket],
                           capture_output=True, text=True, timeout=120)
    assert "fails after 7.5s without progress" in table.stdout


def test_stall_timeout_comes_from_the_environment_by_default(start_daemon):
    daemon = start_daemon(env={"CKPTD_STALL_TIMEOUT": "42", "CKPTD_STUCK_AFTER": "3"})
    deadlines = daemon.status()["deadlines"]
    assert deadlines == {**deadlines, "stall_timeout_s": 42.0, "stuck_after_s": 3.0}


def test_deadlines_set_only_on_the_daemon_make_the_trainer_wait_longer(start_daemon):
    """A stall timeout on ``ckptd serve``'s command line and a save deadline in the
    daemon's environment alone (the trainer's environment has the defaults): the daemon
    says them in its hello, and the trainer's commit and finalize waits outlast them."""
    from ckpt_client import connect
    from ckpt_client.transport import waits

    daemon = start_daemon(extra_args=["--stall-timeout", "1e6"],
                          env={"CKPTD_SAVE_DEADLINE": "1e7"})
    assert "CKPTD_SAVE_DEADLINE" not in os.environ and "CKPTD_STALL_TIMEOUT" not in os.environ
    connection = connect(daemon.socket, auto_start=False)
    try:
        said = connection.deadlines
        assert said.stall_timeout_s == 1e6 and said.save_deadline_s == 1e7
        assert waits.commit_file(connection.deadlines, tiered=False) > 2 * 1e6
        assert waits.save_outcome(connection.deadlines, tiered=False) > 1e7
        assert waits.save_outcome(connection.deadlines, tiered=True) > 1e7
    finally:
        connection.close()


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_stall_timeout_must_be_a_positive_number(tmp_path, value):
    result = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--socket", str(tmp_path / "s.sock"),
         "--stall-timeout", value], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"})
    assert result.returncode == 2
    assert "--stall-timeout" in result.stderr


def test_help_shows_the_stall_timeout_default():
    result = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert "--stall-timeout SECONDS" in result.stdout
    stall_help = " ".join(result.stdout.split("--stall-timeout")[1].split("--metrics")[0].split())
    assert "default: (600.0, or $CKPTD_STALL_TIMEOUT)" in stall_help and "bound method" not in stall_help


# ------------------------------------------------------------------ a stalled storage target

def dcp_saves_around_a_stall(rank, world_size, root, signals):
    """Save A; on "go" save B (the test stalls rank 1's file); on "cleared" save C."""
    queue = AsyncCallsQueue()
    state = lambda value: {f"w{rank}": torch.full((1 << 16,), float(value))}  # noqa: E731
    queue.schedule_async_request(dcp.async_save(state(1), os.path.join(root, "A")))
    queue.maybe_finalize_async_calls(blocking=True)
    await_signal(signals, "go", f"a{rank}")
    outcome = outcome_of(queue, lambda: dcp.async_save(state(2), os.path.join(root, "B")))
    await_signal(signals, "cleared", f"b{rank}")
    return outcome, save_c_then_load(queue, state(3), root, "A")[f"w{rank}"]


def outcome_of(queue, save) -> tuple | None:
    """Schedule ``save()`` and finalize it: None if it succeeds, else its (failing ranks,
    failures) — staging may already fail."""
    try:
        queue.schedule_async_request(save())
        queue.maybe_finalize_async_calls(blocking=True)
        return None
    except CheckpointException as exc:
        return exc.failing_ranks, exc.failures


def save_c_then_load(queue, state: dict, root: str, load: str) -> dict:
    """Save C (the save after the fault), load checkpoint ``load``: the first value of
    each tensor read back (the queue is closed after)."""
    queue.schedule_async_request(dcp.async_save(state, os.path.join(root, "C")))
    queue.maybe_finalize_async_calls(blocking=True)
    loaded = {key: torch.zeros_like(value) for key, value in state.items()}
    DCP.load(loaded, storage_reader=FileSystemReader(os.path.join(root, load)))
    queue.close()
    return {key: float(value[0]) for key, value in loaded.items()}


def await_signal(signals, name: str, done: str, timeout: float = 180.0) -> None:
    """Say ``done``, then wait (in a rank) for the test to create ``name``."""
    open(os.path.join(signals, done), "w").close()
    deadline = time.monotonic() + timeout
    while not os.path.exists(os.path.join(signals, name)):
        assert time.monotonic() < deadline, f"the test never said {name}"
        time.sleep(0.02)  # polling a file the test creates; no event crosses processes


def the_next_save_succeeds(checkpoint: TorchAsyncCheckpoint, path: str) -> None:
    """Once a fault has cleared, a save to the same path commits and loads back."""
    checkpoint.async_save({"w": torch.full((1 << 12,), 2.0)}, path)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.load(path, weights_only=True)["w"][0] == 2.0


def stuck_saves(daemon) -> list:
    return [s for s in daemon.status()["saves"] if s["stuck"]]


@needs_fuse
def test_a_write_stalled_in_fuse_fails_the_save_on_every_rank_and_the_next_one_succeeds(
        start_daemon, tmp_path):
    """The real thing: rank 1's ``.distcp`` file goes to a FUSE target whose writes stop
    answering, so its writer blocks inside ``write()`` in the kernel (and, once killed, sits
    in state D until the target answers). The stall deadline must fail save B on both
    ranks naming rank 1, the file and the phase; status must show B stuck before that, and
    the stuck writer afterwards, its staging bytes held until it really exits."""
    signals = tmp_path / "signals"
    signals.mkdir()
    with FaultFS(tmp_path / "backing", tmp_path / "mnt") as fs:
        daemon = start_daemon(roots=[fs.mount], extra_args=["--stall-timeout", "4"],
                              env={"CKPTD_STUCK_AFTER": "1"})
        processes, results = start_ranks(dcp_saves_around_a_stall, 2, daemon.socket, tmp_path,
                                         args=(fs.mount, str(signals)))
        wait_for(lambda: all((signals / f"a{r}").exists() for r in range(2)), 180, "save A")
        fs.set(stall=True, ops=["write", "fsync"], match="/B/.__1_")  # its temporary
        (signals / "go").touch()
        wait_for(lambda: fs.state()["blocked"] > 0, 60, "rank 1's write held by the stall")
        stuck = wait_for(lambda: stuck_saves(daemon), 30, "status to flag save B as stuck")
        assert stuck[0]["path"] == os.path.join(fs.mount, "B")
        assert stuck[0]["slowest_file"]["rank"] == 1
        assert "/B/__1_" in stuck[0]["slowest_file"]["path"]
        wait_for(lambda: all((signals / f"b{r}").exists() for r in range(2)), 60,
                 "both ranks to be told save B failed")
        status = daemon.status()
        [writer] = status["stuck_writers"]
        assert "/B/__1_" in writer["path"] and writer["phase"] in ("write", "fsync")
        assert status["pool"]["used_bytes"] >= (1 << 16) * 4, \
            "the stuck writer's staging bytes must stay held until it returns"
        assert len([w for w in status["writers"] if w["alive"]]) == 2, "no replacement writer"
        assert not os.path.exists(os.path.join(fs.mount, "B", ".metadata"))
        assert not [n for n in os.listdir(os.path.join(fs.mount, "B"))
                    if n.endswith(".distcp")], "a file of the failed save is visible"
        fs.clear()  # the target answers: the killed writer returns and exits at once
        wait_for(lambda: not daemon.status()["stuck_writers"], 60, "the stuck writer to exit")
        wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "its extent freed")
        (signals / "cleared").touch()
        outcomes = values(collect(processes, results, timeout=180))
        assert os.listdir(os.path.join(tmp_path / "backing", "B")) == [], "leftovers of B"
    for (failing_ranks, failures), value_of_a in outcomes:
        assert failing_ranks == [1]
        message = failures[1]
        assert "rank 1" in message and "/B/__1_" in message and "stalled in phase" in message
        assert "fuse" in message and "--stall-timeout 4s" in message
        assert value_of_a == 1.0
    assert outcomes[0][0] == outcomes[1][0], "every rank must see the same failure"
    assert os.path.exists(os.path.join(tmp_path / "backing", "C", ".metadata"))


def test_a_silent_writer_fails_its_save_and_is_replaced(start_daemon, tmp_path):
    """A SIGSTOPped writer stands in for one stuck in an uninterruptible write: to the daemon
    both are a writer with a job that says nothing. FUSE would be overkill here: what is
    checked is the deadline, the message, the replacement and the next save, not the
    kernel's D state (the FUSE test covers that, and the extent held meanwhile)."""
    daemon = start_daemon(writers=1, extra_args=["--stall-timeout", "3"],
                          env={"CKPTD_STUCK_AFTER": "1"})
    path = os.path.join(daemon.roots[0], "model.pt")
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    try:
        with writers_paused(daemon) as [pid]:
            checkpoint.async_save({"w": torch.ones(1 << 12)}, path)
            wait_for(lambda: stuck_saves(daemon), 30, "status to flag the save as stuck")
            with pytest.raises(CheckpointException) as raised:
                checkpoint.finalize_async_save(blocking=True)
        message = str(raised.value)
        assert "rank 0" in message and path in message and "stalled in phase 'queued'" in message
        assert f"pid {pid}" in message and "--stall-timeout 3s" in message
        assert not os.path.exists(path)
        wait_for(lambda: not daemon.status()["stuck_writers"], 30, "the killed writer reaped")
        the_next_save_succeeds(checkpoint, path)
    finally:
        checkpoint.close()
    [writer] = daemon.status()["writers"]
    assert writer["alive"] and writer["pid"] != pid


def test_a_stopped_daemon_ends_the_wait_and_never_commits_afterwards(daemon, monkeypatch):
    """A SIGSTOPped daemon answers nothing: the trainer's own deadline (the call timeout)
    ends finalize with an error saying what to do; the abort it leaves queued makes the
    resumed daemon drop the save instead of committing what the rank reported failed."""
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", "3")
    path = os.path.join(daemon.roots[0], "model.pt")
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    try:
        with writers_paused(daemon):  # the save stays in flight while the daemon is stopped
            checkpoint.async_save({"w": torch.ones(1 << 12)}, path)
            os.kill(daemon.pid, signal.SIGSTOP)
            try:
                with pytest.raises(CheckpointException) as raised:
                    checkpoint.finalize_async_save(blocking=True)
            finally:
                os.kill(daemon.pid, signal.SIGCONT)
            # The writer resumes only once the daemon has read the queued abort (the save
            # left "saves"): the writer must then drop the job, not rename its file.
            wait_for(lambda: not daemon.status()["saves"], 60, "the resumed daemon's abort")
        message = str(raised.value)
        assert "rank 0" in message and path in message and "did not answer" in message
        assert "ckptd status --socket" in message
        # An aborted save leaves "saves" before its writer answers: wait for the writer.
        wait_for(lambda: not any(w["jobs"] for w in daemon.status()["writers"]), 60,
                 "the writer to answer the dropped save")
        status = daemon.status()
        assert status["totals"]["saves_done"] == 0 and not status["saves"]
        assert not os.path.exists(path), "a save reported failed was committed afterwards"
        written = [r["bytes_written"] for r in status["requests"] if r["path"] == path]
        assert written == [0], "the dropped save's file was renamed into place, then removed"
        the_next_save_succeeds(checkpoint, path)
    finally:
        checkpoint.close()


def test_the_whole_save_deadline_fails_a_save_that_overstays(start_daemon):
    """Writers SIGSTOPped (a silent writer, the stall limit left long): the whole-save
    deadline fires instead, naming the phase; the file written once the writer resumes is
    removed, and the next save succeeds."""
    daemon = start_daemon(writers=1, env={"CKPTD_SAVE_DEADLINE": "2"})
    path = os.path.join(daemon.roots[0], "late.pt")
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    try:
        with writers_paused(daemon):
            checkpoint.async_save({"w": torch.ones(1 << 12)}, path)
            with pytest.raises(CheckpointException) as raised:
                checkpoint.finalize_async_save(blocking=True)
        message = str(raised.value)
        assert "rank 0" in message and "CKPTD_SAVE_DEADLINE" in message
        assert "phase 'writing'" in message
        wait_for(lambda: daemon.status()["writers"][0]["jobs"] == 0, 60, "the late write")
        assert not os.path.exists(path), "the late file of a failed save stayed"
        the_next_save_succeeds(checkpoint, path)
    finally:
        checkpoint.close()


# ------------------------------------------------------------------ a staging copy that stops

def dcp_save_with_a_rank_stopped_in_staging(rank, world_size, root, signals):
    """Save B when the test says "go" (the test stops rank 1 before its copy), then C.

    B stages after planning (a planner that caches its plan is never staged early: an
    early staging that fails is staged again after planning, which is not what is tested
    here)."""
    queue = AsyncCallsQueue()
    state = lambda value: {f"w{rank}": torch.full((4 << 20,), float(value))}  # noqa: E731 16 MiB
    await_signal(signals, "go", f"ready{rank}")
    outcome = outcome_of(queue, lambda: dcp.async_save(
        state(1), os.path.join(root, "B"),
        planner=DefaultSavePlanner(enable_plan_caching=True)))
    return outcome, save_c_then_load(queue, state(2), root, "C")[f"w{rank}"]


def requests_of(daemon, path: str) -> dict:
    """rank -> phase of the requests of the save at ``path``."""
    return {r["rank"]: r["phase"] for r in daemon.status()["requests"] if r["path"] == path}


def test_a_rank_stopped_before_its_copy_fails_the_save_by_the_staging_deadline_on_every_rank(
        start_daemon, tmp_path):
    """Rank 1 is SIGSTOPped while its STAGE waits for pool space (a save of the test's
    holds the pool: its writer is stopped), so when the space is granted its copy cannot
    happen. The staging deadline must fail save B on both ranks naming rank 1 and phase
    'staging'; status shows B stuck before that; rank 1's extent stays held while it is
    stopped (it would copy into it when resumed); nothing of B is visible; C succeeds."""
    signals = tmp_path / "signals"
    signals.mkdir()
    daemon = start_daemon(pool_size="64M", writers=1,
                          env={"CKPTD_STAGING_DEADLINE": "2", "CKPTD_STUCK_AFTER": "0.5"})
    root = daemon.roots[0]
    b_dir = os.path.join(root, "B")
    processes, results = start_ranks(dcp_save_with_a_rank_stopped_in_staging, 2, daemon.socket,
                                     tmp_path, args=(root, str(signals)))
    wait_for(lambda: all((signals / f"ready{r}").exists() for r in range(2)), 180, "the ranks")
    blocker = TorchAsyncCheckpoint(socket=daemon.socket)
    stopped = processes[1].pid
    try:
        with writers_paused(daemon):  # the blocker's 50 MiB stay in the pool meanwhile
            blocker.async_save({"x": torch.zeros(50 << 18)}, os.path.join(root, "blocker.pt"))
            (signals / "go").touch()
            wait_for(lambda: requests_of(daemon, b_dir) == {0: "waiting_for_pool",
                                                           1: "waiting_for_pool"},
                     120, "both ranks' STAGE of B waiting for pool space")
            os.kill(stopped, signal.SIGSTOP)  # no reply yet, so its copy has not begun
        stuck = wait_for(lambda: [s for s in stuck_saves(daemon) if s["path"] == b_dir], 60,
                         "status to flag save B as stuck")
        assert stuck[0]["phases"]["1"] == "staging"
        errors = wait_for(lambda: [e for e in daemon.status()["recent_errors"]
                                   if e["path"] == b_dir], 60, "the staging deadline")
        assert errors[0]["rank"] == 1 and "CKPTD_STAGING_DEADLINE" in errors[0]["error"]
        status = daemon.status()
        assert status["pool"]["used_bytes"] >= 16 << 20, \
            "the stopped rank's extent was freed while it may still copy into it"
        assert not os.path.exists(os.path.join(b_dir, ".metadata"))
    finally:
        os.kill(stopped, signal.SIGCONT)
    outcomes = values(collect(processes, results, timeout=180))
    blocker.finalize_async_save(blocking=True)
    blocker.close()
    for (failing_ranks, failures), value_of_c in outcomes:
        assert failing_ranks == [1]
        assert "rank 1" in failures[1] and "phase 'staging'" in failures[1]
        assert "CKPTD_STAGING_DEADLINE" in failures[1] and "trainer process alive" in failures[1]
        assert value_of_c == 2.0
    visible = [n for n in os.listdir(b_dir) if not n.startswith(".")] \
        if os.path.isdir(b_dir) else []
    assert visible == [] and not os.path.exists(os.path.join(b_dir, ".metadata")), visible
    wait_for(lambda: daemon.status()["pool"]["used_bytes"] == 0, 30, "every extent freed")


def test_a_give_up_after_the_daemon_handled_the_writers_result_still_leaves_nothing(
        daemon, monkeypatch):
    """The order the resume race can take, forced: the daemon handles the writer's result
    (the save is done in its books, the file at its final name) before the trainer ever
    hears it; then the daemon is SIGSTOPped, the trainer's finalize gives up on it and
    reports failure. When the daemon resumes it reads the queued abort and delete after
    that result: the file goes, so no rank reports failure for a save that stays."""
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", "3")
    path = os.path.join(daemon.roots[0], "raced.pt")
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    try:
        checkpoint.async_save({"w": torch.ones(1 << 12)}, path)
        wait_for(lambda: daemon.status()["totals"]["saves_done"] == 1, 60,
                 "the daemon to handle the writer's result")
        assert os.path.exists(path)  # done in the daemon's books; the trainer polled nothing
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(CheckpointException) as raised:
                checkpoint.finalize_async_save(blocking=True)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert "gave up" in str(raised.value) and "ckptd status --socket" in str(raised.value)
        wait_for(lambda: not os.path.exists(path), 60, "the resumed daemon to remove the file")
        assert not [r for r in daemon.status()["requests"] if r["path"] == path
                    and r["phase"] not in ("done", "aborted", "failed")]
        the_next_save_succeeds(checkpoint, path)
    finally:
        checkpoint.close()


def test_a_save_behind_a_held_zero_stall_save_goes_on_once_the_hold_runs_out(start_daemon):
    """A zero-stall save whose bytes are copied but held (the early staging's ``hold``,
    never released here) keeps the connection's background thread busy; a blocking save on
    the same connection waits for it first. The hold is bounded by the daemon's staging
    deadline (the daemon has failed the held save by then): the held save is dropped,
    saying why, and the save behind it is staged, not left to hang."""
    import threading

    from ckpt_client import connect
    from ckpt_client.transport.handover import stage
    from ckptd import knobs

    tiny = dict(STAGE_TIMEOUT=0.3, STAGING_DEADLINE=0.3, CALL_TIMEOUT=0.3, SERVE_TICK=0.05,
                WAIT_MARGIN=0.0)
    daemon = start_daemon(env={f"CKPTD_{name}": str(value) for name, value in tiny.items()})
    root, hold, outcome = daemon.roots[0], threading.Event(), {}
    with knobs.override(**tiny):
        connection = connect(daemon.socket, auto_start=False)
        try:
            stuck = stage(connection, "torch", os.path.join(root, "held.pt"),
                          [torch.ones(1 << 10)], zero_stall=True, hold=hold)

            def blocking_save() -> None:
                try:
                    outcome["save"] = stage(connection, "torch", os.path.join(root, "next.pt"),
                                            [torch.ones(8)])
                except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                    outcome["error"] = exc

            thread = threading.Thread(target=blocking_save, daemon=True)
            thread.start()
            thread.join(timeout=60)
            assert not thread.is_alive(), "the blocking save still waits for the held one"
            assert "error" not in outcome, outcome.get("error")
            with pytest.raises(CheckpointException, match="not released to the writers"):
                stuck.wait_staged(timeout=30)
        finally:
            hold.set()
            connection.close()


@needs_fuse
def test_a_zero_stall_save_dropped_mid_copy_keeps_its_space_until_the_copy_is_over(
        start_daemon, tmp_path):
    """The background copy of a zero-stall save is held mid-copy (its source tensor maps a
    file on a FUSE mount whose reads are stalled, so the copier thread blocks in a page
    fault), and ``close(abort=True)`` drops the save. A second save (another process) must
    not be given that space while the copy can still write into it: once the copy goes on,
    the second save's file must hold its own bytes, not the dropped save's."""
    from ckpt_client import connect
    from ckpt_client.transport.handover import handover_for

    count = 1 << 21  # 8 MiB of float32: the pool holds one such save, not two
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    with FaultFS(backing, mount) as fs:
        # Written beside the mount: no page of it is cached on the FUSE side, so the copy
        # reads it through the (stalled) server.
        torch.full((count,), 1.0).numpy().tofile(backing / "source.bin")
        daemon = start_daemon(pool_size="12M", writers=1)
        root = daemon.roots[0]
        first, second = os.path.join(root, "first.pt"), os.path.join(root, "second.pt")
        fs.set(stall=True, ops=["read"], match="source.bin")
        source = torch.from_file(str(mount / "source.bin"), size=count, dtype=torch.float32)
        checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
        checkpoint.async_save({"w": source}, first, zero_stall=True)
        wait_for(lambda: fs.state()["blocked"] > 0, 60, "the background copy to block")
        checkpoint.close(abort=True)
        script = (f"import torch\nfrom ckpt_client import TorchAsyncCheckpoint\n"
                  f"c = TorchAsyncCheckpoint(socket={daemon.socket!r})\n"
                  f"c.async_save({{'w': torch.full(({count},), 2.0)}}, {second!r})\n"
                  f"c.finalize_async_save(blocking=True)\nc.close()\n")
        with writers_paused(daemon):
            other = subprocess.Popen([sys.executable, "-c", script])
            try:
                wait_for(lambda: any(r["path"] == second and r["phase"] in
                                     ("waiting_for_pool", "writing")
                                     for r in daemon.status()["requests"]), 120,
                         "the second save to ask for space")
                fs.clear()  # the dropped save's copy goes on, into its extent
                handover_for(connect(daemon.socket, auto_start=False)).wait_for_background()
            finally:
                fs.clear()
        assert other.wait(timeout=120) == 0
        checkpoint.close()
        # The source maps a file on the mount: while it lives the mount is busy, and the
        # FUSE server cannot exit (stop() then waits 10 s for it before killing it).
        del source
    assert torch.equal(torch.load(second, weights_only=True)["w"], torch.full((count,), 2.0)), \
        "the dropped save's late copy wrote into the second save's staging space"
    assert not os.path.exists(first)


def test_a_commit_file_that_overstays_is_failed_by_the_daemon_and_never_lands(start_daemon):
    """The whole-save deadline bounds a ``.metadata`` commit however its write goes (the
    stall limit is left at 600 s, and the writer is SIGSTOPped: no progress report can
    tell the daemon anything): the daemon fails the commit naming the file and the limit,
    replaces the writer (so the file cannot land afterwards), and the next commit works.
    The trainer's own wait (``waits.commit_file``) is far longer: the daemon judges."""
    from ckpt_client import connect
    from ckpt_client.transport import waits
    from ckptd.protocol import CommitFile, MessageType
    from ckpt_client.errors import DaemonRequestError

    daemon = start_daemon(writers=1, env={"CKPTD_SAVE_DEADLINE": "2"})
    path = os.path.join(daemon.roots[0], "ckpt", ".metadata")
    os.makedirs(os.path.dirname(path))
    connection = connect(daemon.socket, auto_start=False)
    try:
        assert waits.commit_file(connection.deadlines, tiered=False) > 2 + 30
        with writers_paused(daemon) as [pid]:
            with pytest.raises(DaemonRequestError) as raised:
                connection.call(MessageType.COMMIT_FILE, CommitFile(path=path),
                                frames=[b"late"], timeout=60)
        message = str(raised.value)
        assert path in message and "CKPTD_SAVE_DEADLINE" in message, message
        assert f"writer (pid {pid}) was replaced" in message
        wait_for(lambda: not daemon.status()["stuck_writers"], 30, "the replaced writer gone")
        assert not os.path.exists(path), "a commit the daemon failed landed afterwards"
        connection.call(MessageType.COMMIT_FILE, CommitFile(path=path), frames=[b"next"],
                        timeout=waits.commit_file(connection.deadlines, tiered=False))
        with open(path, "rb") as f:
            assert f.read() == b"next"
    finally:
        connection.close()
