"""What the framework tests share: the kill-mid-save sequence and exact state comparison."""

from __future__ import annotations

import os
import signal
import sys

import torch

# tests/integration's fault helpers, by name (as its own tests import them)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from conftest import wait_for  # noqa: E402 - tests/conftest.py
from faults import writers_paused  # noqa: E402
import gates  # noqa: E402


def in_flight(daemon) -> list:
    """The daemon's save requests that are not finished yet."""
    return [r for r in daemon.status()["requests"]
            if r["phase"] not in ("done", "failed", "aborted")]


def kill_while_writing(daemon, trainer, gate_dir: str, durable_gate: str, staged_gate: str,
                       log_path: str, root: str) -> None:
    """Let ``trainer`` reach ``durable_gate`` (earlier saves durable), pause the daemon's
    writers, let it hand over the next save (``staged_gate``), SIGKILL it while that
    save is being written, and wait until the daemon dropped the orphaned save and no
    temporary file is left under ``root``."""
    wait_for(lambda: _alive_at(trainer, gate_dir, durable_gate, log_path), 180,
             f"the trainer at {durable_gate}")
    with writers_paused(daemon):
        gates.release(gate_dir, durable_gate)
        _kill_at(daemon, trainer, gate_dir, staged_gate, log_path)
    _no_temporary_file_under(root)


def _alive_at(trainer, gate_dir: str, gate: str, log_path: str) -> bool:
    if trainer.poll() is not None:
        with open(log_path, errors="replace") as f:
            raise AssertionError(f"trainer exited {trainer.returncode}:\n{f.read()[-6000:]}")
    return gates.reached(gate_dir, gate)


def _kill_at(daemon, trainer, gate_dir: str, staged_gate: str, log_path: str) -> None:
    """With the writers paused: SIGKILL ``trainer`` once it reached ``staged_gate`` with a
    save in flight, and wait until the daemon dropped that save."""
    wait_for(lambda: _alive_at(trainer, gate_dir, staged_gate, log_path), 180,
             f"the trainer at {staged_gate}")
    assert in_flight(daemon), "the save should still be in flight while writers are paused"
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(30)
    wait_for(lambda: not in_flight(daemon), 60, "the daemon to drop the killed trainer's save")


def _no_temporary_file_under(root: str) -> None:
    # the paused writer, let go, finds its job aborted and removes its temporary file
    wait_for(lambda: not any(n.endswith(".ckptd-tmp") for n in files_under(root)), 60,
             f"no temporary file left under {root}")


def assert_same(actual, expected, where: str = "state") -> None:
    """Bit-for-bit equality of nested dicts / lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where} differs"
    elif isinstance(expected, dict):
        assert set(actual) == set(expected), f"{where}: keys {sorted(map(str, actual))} != {sorted(map(str, expected))}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: length"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def files_under(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, names in os.walk(root) for f in names)


class KilledRun:
    """A trainer script (``SCRIPT ROOT REFS GATES STEPS [extra...] [resume]``) run until it
    is SIGKILLed mid-save (:func:`kill_while_writing` at steps 4 and 6), then resumed."""

    def __init__(self, daemon, tmp_path, script: str, root: str, extra: tuple = ()) -> None:
        self.daemon, self.tmp_path, self.script, self.root = daemon, tmp_path, script, root
        self.extra = list(extra)
        self.refs, self.gates = tmp_path / "refs", tmp_path / "gates"
        self.refs.mkdir()
        self.gates.mkdir()

    def _args(self, steps: int) -> list[str]:
        return [self.root, str(self.refs), str(self.gates), str(steps), *self.extra]

    def kill_mid_save(self, steps: int) -> None:
        log = str(self.tmp_path / "train.log")
        trainer = gates.start_trainer(self.script, self._args(steps), self.daemon.socket, log)
        kill_while_writing(self.daemon, trainer, str(self.gates), "durable4", "staged6", log,
                           self.root)

    def kill_resumed_mid_save(self, steps: int, staged_gate: str, *flags: str) -> None:
        """Resume with the daemon's writers paused (``flags`` after ``resume``), SIGKILL
        the trainer at ``staged_gate`` while its save is being written."""
        log = str(self.tmp_path / "resumed-killed.log")
        with writers_paused(self.daemon):
            trainer = gates.start_trainer(self.script, self._args(steps) + ["resume", *flags],
                                          self.daemon.socket, log)
            _kill_at(self.daemon, trainer, str(self.gates), staged_gate, log)
        _no_temporary_file_under(self.root)

    def resume(self, steps: int) -> None:
        gates.run_trainer(self.script, self._args(steps) + ["resume"], self.daemon.socket,
                          str(self.tmp_path / "resume.log"))

    def reference(self, name: str):
        """What the trainer recorded: ``step-N`` (the state saved at step N) or ``resumed``."""
        return torch.load(self.refs / f"{name}.pt", weights_only=False)
