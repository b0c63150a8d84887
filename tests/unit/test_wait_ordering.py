"""The daemon judges a save's deadlines; a trainer's waits always outlast them.

Three checks, each of which fails when someone breaks the order:

- the trainer's waits (:mod:`ckpt_client.transport.waits`) exceed the daemon's deadline for
  the same thing plus its check granularity, for default, tiny, huge and hostile settings;
- the daemon's own check (:class:`ckptd.server.deadlines.SaveDeadlines`) fails a request
  by then (a real request table, the deadline's clock moved by the request's timestamps);
- every call in the client that waits on one of those daemon decisions takes its timeout
  from ``waits``, not from a knob or a number (read from the source with ``ast``).
"""

from __future__ import annotations

import ast
import os

import pytest

from ckptd import knobs
from ckptd.protocol import DaemonDeadlines, Phase
from ckptd.server.deadlines import SaveDeadlines
from ckptd.server.requests import SaveRequest
from ckpt_client.transport import waits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {
    "defaults": {},
    "tiny": dict(CALL_TIMEOUT=0.1, SERVE_TICK=0.01, WAIT_MARGIN=0.0, STAGE_TIMEOUT=0.5,
                 STAGING_DEADLINE=0.5, SAVE_DEADLINE=1.0, FLUSH_DEADLINE=1.0,
                 LOCAL_LOAD_TIMEOUT=0.5, STALL_TIMEOUT=0.5),
    "huge deadlines": dict(STAGE_TIMEOUT=1e6, STAGING_DEADLINE=1e6, SAVE_DEADLINE=1e7,
                           FLUSH_DEADLINE=1e7, LOCAL_LOAD_TIMEOUT=1e6, STALL_TIMEOUT=1e6),
    "slow tick, short calls": dict(SERVE_TICK=5.0, CALL_TIMEOUT=1.0, WAIT_MARGIN=0.0),
    "negative margin": dict(WAIT_MARGIN=-1e6),
}


def daemon_decides_by() -> dict:
    """When, at the latest, the daemon has decided each thing (its deadline plus one
    housekeeping tick), and a poll asked just before that has its answer."""
    tick, call = knobs.SERVE_TICK.get(), knobs.CALL_TIMEOUT.get()
    save = knobs.SAVE_DEADLINE.get()
    return {
        "stage_reply": knobs.STAGE_TIMEOUT.get() + tick,
        "staged_reply": knobs.STAGING_DEADLINE.get() + tick,
        "save_outcome(non-tiered)": save + tick + call,
        "save_outcome(tiered)": save + knobs.FLUSH_DEADLINE.get() + tick + call,
        "local_load": knobs.LOCAL_LOAD_TIMEOUT.get() + tick,
        # A commit file has the whole-save deadline from its arrival, writer or no writer.
        "commit_file(non-tiered)": save + tick,
        "commit_file(tiered)": save + knobs.FLUSH_DEADLINE.get() + tick + call,
    }


def trainer_waits(said: DaemonDeadlines | None = None) -> dict:
    """Each trainer wait, with ``said`` the daemon's hello (None: an older daemon)."""
    return {"stage_reply": waits.stage_reply(said), "staged_reply": waits.staged_reply(said),
            "save_outcome(non-tiered)": waits.save_outcome(said, tiered=False),
            "save_outcome(tiered)": waits.save_outcome(said, tiered=True),
            "local_load": waits.local_load(said),
            "commit_file(non-tiered)": waits.commit_file(said, tiered=False),
            "commit_file(tiered)": waits.commit_file(said, tiered=True)}


def deadlines_of_a_daemon_with(**values) -> DaemonDeadlines:
    """The hello's deadlines of a daemon whose knobs are ``values`` (the rest defaults),
    built the way the daemon builds them."""
    with knobs.override(**values):
        return SaveDeadlines(None, None, None, knobs.STALL_TIMEOUT.get()).enforced()


@pytest.mark.parametrize("setting", SETTINGS)
def test_every_trainer_wait_outlasts_the_daemon_deadline_for_the_same_thing(setting):
    with knobs.override(**SETTINGS[setting]):
        daemon, trainer = daemon_decides_by(), trainer_waits()
        short = {k: (trainer[k], daemon[k]) for k in daemon if not trainer[k] > daemon[k]}
        assert not short, f"trainer waits (trainer, daemon) not longer than the daemon's: {short}"
        assert waits.staging(None) > waits.stage_reply(None) + waits.staged_reply(None)


@pytest.mark.parametrize("daemon_setting", SETTINGS)
@pytest.mark.parametrize("trainer_setting", ["defaults", "tiny"])
def test_a_deadline_set_only_where_the_daemon_runs_still_makes_the_trainer_wait_longer(
        daemon_setting, trainer_setting):
    """The daemon's command line and environment are not the trainer's: what the daemon
    said in its hello must lengthen the trainer's waits (the daemon's deadlines come from
    its settings, the trainer's own knobs from another)."""
    said = deadlines_of_a_daemon_with(**SETTINGS[daemon_setting])
    # A poll in flight when the daemon decides is the trainer's call, with its timeout.
    call = SETTINGS[trainer_setting].get("CALL_TIMEOUT", knobs.CALL_TIMEOUT.default)
    with knobs.override(**{**SETTINGS[daemon_setting], "CALL_TIMEOUT": call}):
        daemon = daemon_decides_by()
    with knobs.override(**SETTINGS[trainer_setting]):
        own, trainer = daemon_decides_by(), trainer_waits(said)
    short = {k: (trainer[k], daemon[k], own[k]) for k in daemon
             if not trainer[k] > max(daemon[k], own[k])}
    assert not short, f"trainer waits (trainer, daemon, own) not longer than both: {short}"


def test_the_trainer_waits_in_the_background_for_every_queued_save():
    said = deadlines_of_a_daemon_with(STAGING_DEADLINE=5e5)
    assert waits.background_staging(said, 3) >= 3 * waits.staging(said) > 3 * 5e5
    assert waits.background_staging(None, 0) == waits.staging(None)


def test_an_older_daemon_without_deadlines_in_its_hello_still_works():
    from ckptd.protocol import HelloReply, ProtocolError

    hello = dict(daemon_pid=1, incarnation="x", version="0", pool_path="/p", pool_size=1)
    assert HelloReply.from_wire(hello).deadlines is None
    said = deadlines_of_a_daemon_with().to_wire()
    assert HelloReply.from_wire({**hello, "deadlines": said}).deadlines.save_deadline_s == \
        knobs.SAVE_DEADLINE.default
    with pytest.raises(ProtocolError, match="stall_timeout_s"):
        HelloReply.from_wire({**hello, "deadlines": {**said, "stall_timeout_s": -1.0}})
    assert waits.save_outcome(None, tiered=False) == trainer_waits()["save_outcome(non-tiered)"]


def test_the_order_holds_when_the_deadlines_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("CKPTD_SAVE_DEADLINE", "90000")
    monkeypatch.setenv("CKPTD_STAGING_DEADLINE", "4000")
    monkeypatch.setenv("CKPTD_CALL_TIMEOUT", "1")
    monkeypatch.setenv("CKPTD_STALL_TIMEOUT", "7000")
    assert waits.save_outcome(None, tiered=False) > 90000 + knobs.SERVE_TICK.get() + 1
    assert waits.staged_reply(None) > 4000
    assert waits.commit_file(None, tiered=False) > 90000


# ------------------------------------------------------------------ the daemon's side

def request(phase: str, age: float, now: float, **fields) -> SaveRequest:
    made = SaveRequest(id=1, rank=3, routing_id=b"r", format="torch", path="/ckpt/x.pt",
                       buffers=[["float32", [4], 16]], offsets=[0], extent_length=4096,
                       phase=phase, created_at=now - age, **fields)
    return made


class Lease:
    def has(self, name: str) -> bool:
        return name == "client-copy"


@pytest.mark.parametrize("setting", ["defaults", "tiny", "huge deadlines"])
def test_the_daemon_fails_a_save_before_the_trainer_would_give_up(setting):
    """At the moment the trainer's wait would end (measured from the same start), the
    daemon's check has already failed the request; at the daemon's deadline minus a
    little it has not (so the test can fail both ways)."""
    now = 1e9
    overdue = SaveDeadlines._overdue
    with knobs.override(**SETTINGS[setting]):
        waiting = knobs.STAGE_TIMEOUT.get()
        assert overdue(request(Phase.WAITING_FOR_POOL, waits.stage_reply(None), now), now)
        assert overdue(request(Phase.WAITING_FOR_POOL, waiting * 0.99, now), now) is None
        staging = knobs.STAGING_DEADLINE.get()
        late = request(Phase.STAGING, 0.0, now, lease=Lease(), copiers=("client-copy",),
                       staging_since=now - waits.staged_reply(None))
        assert "CKPTD_STAGING_DEADLINE" in overdue(late, now)
        early = request(Phase.STAGING, 0.0, now, lease=Lease(), copiers=("client-copy",),
                        staging_since=now - staging * 0.99)
        assert overdue(early, now) is None
        save = knobs.SAVE_DEADLINE.get()
        assert "CKPTD_SAVE_DEADLINE" in overdue(
            request(Phase.WRITING, waits.save_outcome(None, tiered=False), now), now)
        assert overdue(request(Phase.WRITING, save * 0.99, now), now) is None
        # A tiered flush has its own, longer deadline (the flusher's): the whole-save
        # deadline must not cut it short.
        assert overdue(request(Phase.FLUSHING, save * 2, now), now) is None


# ------------------------------------------------------------------ the client's calls

#: Requests whose answer waits on a daemon decision that has a deadline.
JUDGED = {"STAGE": "stage_reply", "STAGED": "staged_reply",
          "LOCAL_INVENTORY": "local_load", "LOCAL_FETCH": "local_load",
          "COMMIT_FILE": "commit_file"}
DAEMON_DEADLINE_KNOBS = {"STAGE_TIMEOUT", "STAGING_DEADLINE", "SAVE_DEADLINE", "FLUSH_DEADLINE",
                         "LOCAL_LOAD_TIMEOUT", "STALL_TIMEOUT"}


def client_sources():
    base = os.path.join(ROOT, "ckpt_client")
    for directory, _, names in os.walk(base):
        for name in names:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, ROOT), ast.parse(open(path).read())


def test_client_calls_that_wait_on_a_daemon_deadline_take_their_timeout_from_waits():
    wrong, seen = [], set()
    for path, tree in client_sources():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            called = node.func.attr if isinstance(node.func, ast.Attribute) else None
            if called == "send":  # sending waits for nothing; its reply_to() does
                continue
            first = node.args[1] if called == "reply_to" and len(node.args) > 1 else node.args[0]
            if not (isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name)
                    and first.value.id == "MessageType" and first.attr in JUDGED):
                continue
            seen.add(first.attr)
            timeout = next((k.value for k in node.keywords if k.arg == "timeout"), None)
            wanted = JUDGED[first.attr]
            if not (isinstance(timeout, ast.Call) and isinstance(timeout.func, ast.Attribute)
                    and isinstance(timeout.func.value, ast.Name)
                    and timeout.func.value.id == "waits" and timeout.func.attr == wanted):
                wrong.append(f"{path}:{node.lineno}: a {first.attr} call must wait "
                             f"timeout=waits.{wanted}(connection.deadlines, ...)")
            elif not (timeout.args and isinstance(timeout.args[0], ast.Attribute)
                      and timeout.args[0].attr == "deadlines"):
                wrong.append(f"{path}:{node.lineno}: waits.{wanted}() must be given the "
                             f"connection's deadlines (what the daemon said in its hello)")
    assert not wrong, "\n".join(wrong)
    assert seen == set(JUDGED), f"no client call found for {set(JUDGED) - seen}"


def test_no_client_wait_uses_a_daemon_deadline_knob_directly():
    wrong = []
    for path, tree in client_sources():
        if path.endswith(os.path.join("transport", "waits.py")):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "knobs" and node.attr in DAEMON_DEADLINE_KNOBS):
                wrong.append(f"{path}:{node.lineno}: knobs.{node.attr} (use ckpt_client."
                             f"transport.waits, which outlasts the daemon's deadline)")
    assert not wrong, "\n".join(wrong)
