"""Shared fixtures: a real ckptd daemon process, and real multi-rank gloo groups.

Pattern (from ipyparallel's tests): start the real daemon as a subprocess and wait on
its ready file with a timeout, failing fast (with its log) if the process exits first.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

from ckptd import protocol

# Spawned trainer processes import test helpers (multirank, the test modules) by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _cache_subprocess_bytecode() -> None:
    # The suite starts well over a thousand Python processes (each daemon and its writers,
    # trainers, probes). Where the environment forbids writing bytecode
    # (PYTHONDONTWRITEBYTECODE), each compiled every ckptd module it imported again: a
    # daemon was ready after ~1.3 s instead of ~0.6 on a loaded 2-core machine. They keep
    # it in a cache of their own instead, outside the source tree (which is what the
    # setting protects); where it is not set, Python's own __pycache__ is used as ever.
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        import tempfile

        os.environ["PYTHONPYCACHEPREFIX"] = os.path.join(
            tempfile.gettempdir(), f"ckptd-tests-pycache-{os.getuid()}")
        del os.environ["PYTHONDONTWRITEBYTECODE"]


_cache_subprocess_bytecode()

READY_TIMEOUT = 120.0


def pytest_collection_modifyitems(config, items):
    """Soak and long tests (``slow``) run only when asked for: the default suite must stay
    under 15 minutes on 2 cores."""
    if "slow" in (config.getoption("markexpr") or "") or os.environ.get("CKPTD_SLOW_TESTS"):
        return
    skip = pytest.mark.skip(reason="slow (soak or long-running): run with -m slow or "
                                   "CKPTD_SLOW_TESTS=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def hold_lock(path) -> subprocess.Popen:
    """Another process that holds an exclusive ``flock`` on ``path`` until it is killed (a
    writer still exiting, a daemon of another pid namespace); returns once it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], "
         "os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); "
         "time.sleep(600)", str(path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "locked\n"
    return holder


def wait_for(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll ``predicate`` until it returns a truthy value; fail the test after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


@dataclass
class DaemonProcess:
    """A running ``ckptd serve`` started by a test."""

    socket: str
    roots: list
    process: subprocess.Popen
    log_path: str
    env: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def status(self) -> dict:
        """The daemon's status document, via the real CLI path."""
        from ckptd.status import query_status

        code, doc, why = query_status(self.socket, timeout=10)
        assert code == 0, why
        return doc

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_daemon_process(tmp_path, *, roots=None, pool_size="256M", writers=2,
                         extra_args=(), env=None, name="d", preexec_fn=None) -> DaemonProcess:
    """Start ``python -m ckptd serve`` and wait until its ready file names its pid
    (``preexec_fn`` runs in the child before it starts, e.g. a seccomp filter)."""
    run_dir = tmp_path / f"run-{name}"
    socket_path = str(run_dir / "ckptd.sock")
    roots = [str(r) for r in (roots or [tmp_path / "ckpt"])]
    for root in roots:
        os.makedirs(root, exist_ok=True)
    log_path = str(tmp_path / f"ckptd-{name}.log")
    command = [sys.executable, "-m", "ckptd", "serve", "--socket", socket_path,
               "--pool-size", pool_size, "--writers", str(writers), *extra_args]
    for root in roots:
        command += ["--root", root]
    full_env = {**os.environ, **(env or {})}
    full_env.pop("CKPTD_SOCKET", None)
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=full_env,
                                   preexec_fn=preexec_fn)
    daemon = DaemonProcess(socket_path, roots, process, log_path, full_env)
    problem = protocol.wait_until_ready(socket_path, process, READY_TIMEOUT)
    if problem:
        pytest.fail(f"ckptd {problem}:\n{daemon.log()}")
    return daemon


@pytest.fixture
def start_daemon(tmp_path):
    """Factory: ``start_daemon(**options) -> DaemonProcess``; all are stopped afterwards."""
    started: list[DaemonProcess] = []

    def start(**options) -> DaemonProcess:
        daemon = start_daemon_process(tmp_path, name=f"d{len(started)}", **options)
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop(signal.SIGKILL if daemon.process.poll() is None else signal.SIGTERM, 30)
        _remove_pool_of(daemon)


def _remove_pool_of(daemon: DaemonProcess) -> None:
    # This process's connection to the daemon (ckpt_client keeps one per socket) maps its
    # pool until closed: hundreds of tests' pools would fill the machine's memory.
    from ckpt_client.transport.connection import _connections

    leftover = _connections.get(daemon.socket)
    if leftover is not None:
        leftover.close()
    # A SIGKILLed daemon cannot unlink its pool; tests must not leak /dev/shm.
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptd-{os.getuid()}-{daemon.pid}-"):
            os.unlink(os.path.join("/dev/shm", name))


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory):
    """One daemon for a whole module, for tests that leave it as they found it."""
    tmp_path = tmp_path_factory.mktemp("shared")
    daemon = start_daemon_process(tmp_path, name="shared")
    yield daemon
    daemon.stop(signal.SIGKILL if daemon.process.poll() is None else signal.SIGTERM, 30)
    _remove_pool_of(daemon)


@pytest.fixture
def daemon(start_daemon):
    """One daemon with the default options (roots: ``tmp_path/ckpt``)."""
    return start_daemon()


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
