"""Gates between a test and a training subprocess it will SIGKILL: files in a directory.

The trainer calls :func:`reach` at a known point (it writes ``<name>.reached`` and, with
``hold``, waits for ``<name>.go``); the test waits for the marker with a timeout, acts
(pauses the daemon's writers, kills the trainer), and :func:`release`-s it. No sleeps:
both sides wait on a file appearing, bounded.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


def start_trainer(script: str, args: list[str], socket: str, log_path: str) -> subprocess.Popen:
    """Run ``script`` (a module of this directory) with ``CKPTD_SOCKET`` set."""
    env = {**os.environ, "CKPTD_SOCKET": socket, "CKPTD_AUTO_START": "0",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.abspath(__file__)),
                                          os.environ.get("PYTHONPATH", "")])}
    log = open(log_path, "wb")
    return subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), script),
                             *args], env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)


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
