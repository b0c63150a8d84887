"""Gates between a test and a training subprocess it will SIGKILL: files in a directory.

The trainer calls :func:`reach` at a known point (it writes ``<name>.reached`` and, with
``hold``, waits for ``<name>.go``); the test waits for the marker with a timeout, acts
(pauses the daemon's writers, kills the trainer), and :func:`release`-s it. No sleeps:
both sides wait on a file appearing, bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

HOLD_TIMEOUT = 120.0


def reach(gate_dir: str, name: str, hold: bool = False) -> None:
    """Trainer side: say ``name`` was reached; with ``hold``, wait to be released."""
    open(os.path.join(gate_dir, f"{name}.reached"), "w").close()
    deadline = time.monotonic() + HOLD_TIMEOUT
    while hold and not os.path.exists(os.path.join(gate_dir, f"{name}.go")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {name} was not released within {HOLD_TIMEOUT:.0f}s")
        time.sleep(0.01)  # polling for the test's release file


def release(gate_dir: str, name: str) -> None:
    """Test side: let a trainer held at ``name`` go on."""
    open(os.path.join(gate_dir, f"{name}.go"), "w").close()


def reached(gate_dir: str, name: str) -> bool:
    return os.path.exists(os.path.join(gate_dir, f"{name}.reached"))


class Trainer:
    """A trainer process forked by the tests' fork server (``tests/nodeforks.py``), as
    ``subprocess.Popen`` is used: ``pid`` (it leads its own session and process group),
    ``poll``, ``wait``, ``send_signal``, ``kill``, ``returncode``."""

    def __init__(self, server, pid: int) -> None:
        self.server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self.server.exited(self.pid):
            self.returncode = self.server.wait(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.wait(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"trainer {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # once reaped, its pid may be anyone's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_trainer(script: str, args: list[str], socket: str, log_path: str) -> Trainer:
    """Run ``script`` (a module of this directory) with ``CKPTD_SOCKET`` set, forked from
    the tests' fork server, which imported torch and the script's own imports (the
    framework: 2-4 s of CPU a trainer) once for the whole test process."""
    env = {**os.environ, "CKPTD_SOCKET": socket, "CKPTD_AUTO_START": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    from bednodes import fork_server  # the test side only (trainers import this module too)

    server = fork_server()
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    pid = server.run_script([path, *args], os.path.splitext(script)[0], env, log_path)
    return Trainer(server, pid)


def run_trainer(script: str, args: list[str], socket: str, log_path: str,
                timeout: float = 240.0) -> None:
    """Run ``script`` to the end; fail with its log if it fails."""
    process = start_trainer(script, args, socket, log_path)
    try:
        code = process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        code = "timeout"
    if code != 0:
        with open(log_path, errors="replace") as f:
            raise AssertionError(f"{script} {' '.join(args)} exited {code}:\n{f.read()[-6000:]}")
