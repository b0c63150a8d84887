"""A fork server for bed ranks: torch imported once, each rank forked from it into its node.

A rank started as a fresh ``python`` inside a node spent 2-3 s of CPU importing torch and
the test module before doing anything; a four-node test starts sixteen of them on 2 cores,
and a server per node still imported torch once per node and test (an eight-node bed:
eight imports, ~10 s of the machine). :class:`NodeForkServer` imports torch,
``torch.distributed``, ``ckpt_client`` and the module of the function the ranks run, and
then only forks. ``tests/bednodes.py`` starts one on this host for the whole test process
(:class:`HostPopen`, outside every bed); each forked rank first enters its node's network
namespace (``setns``, the job's ``netns``: what ``ip netns exec`` does for a process
started there), then gets a session of its own (the test kills its group on a timeout),
its own log as stdout and stderr, and exactly the environment a rank started with
``NetBed.popen`` would have. The server ran nothing but those imports, so no rank
inherits anything of another rank or test. The same pattern as the ``forkserver`` that
``tests/multirank.py`` forks single-host ranks from.

Wire (pipes to the test process, one line each): the test writes a JSON job
``{"id", "job", "env", "log", "module", "netns"}``; the server answers ``started ID PID``
for it, and ``exited PID CODE`` when that rank ends (``CODE`` as ``Popen.returncode``:
negative for a signal). End of input stops the server; ranks still running are the bed's
to kill (they are in its namespaces). A fork whose ``started`` line did not come in time
fails; the line carries its job's id, so when it comes late it is never taken for a later
job's rank: that rank, which nobody waits for, is killed instead
(:attr:`NodeForkServer.discarded`).
"""

from __future__ import annotations

import ctypes
import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import runpy
import threading
import traceback

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS_DIR)
#: Where rank functions and trainer scripts live: the test helpers, the integration tests
#: and their framework trainers, the benchmarks.
RANK_PATH = [TESTS_DIR, os.path.join(TESTS_DIR, "integration"),
             os.path.join(TESTS_DIR, "integration", "frameworks"), os.path.join(ROOT, "benchmarks")]
#: Seconds the server may take to import torch and answer its first job.
START_TIMEOUT = 120.0
_CLONE_NEWNET = 0x40000000


class HostPopen:
    """``popen`` as a bed node's, but on this host (no namespace): a session of its own,
    ``env`` added to this process's environment. Where the shared fork server runs."""

    def popen(self, node: int, argv: list, *, env: dict | None = None, **kwargs):
        return subprocess.Popen(argv, env={**os.environ, **(env or {})},
                                start_new_session=True, **kwargs)


class NodeForkServer:
    """The test process's end of one node's fork server (see the module docstring).

    Parameters
    ----------
    bed : netbed.NetBed or HostPopen
        Whose ``popen`` starts the server: a bed that is up, or this host.
    node : int
        The node (of ``bed``) the server runs in.
    log_path : str
        The server's own output (an import that failed, a traceback).
    """

    def __init__(self, bed, node: int, log_path: str) -> None:
        self.node, self.log_path = node, log_path
        with open(log_path, "ab") as log:
            self.proc = bed.popen(node, [sys.executable, os.path.abspath(__file__)],
                                  env={"PYTHONPATH": ROOT}, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log)
        self._started: dict[int, int] = {}  # job id -> pid, for the forks still waiting
        self._waiting: set[int] = set()       # ids of the jobs whose fork waits for them
        self._next_id = 0
        #: Ranks whose ``started`` line came after their fork gave up: killed on arrival.
        self.discarded: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        self._changed = threading.Condition()
        self._one_job = threading.Lock()
        threading.Thread(target=self._read, name=f"forks-n{node}", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            kind, *fields = line.split() or [b""]
            try:
                numbers = [int(field) for field in fields]
            except ValueError:
                continue  # a stray line (a print at import) is not the server's
            if kind == b"started" and len(numbers) == 2:
                self._on_started(*numbers)
            elif kind == b"exited" and len(numbers) == 2:
                with self._changed:
                    self._exits[numbers[0]] = numbers[1]
                    self._changed.notify_all()
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def _on_started(self, job_id: int, pid: int) -> None:
        with self._changed:
            if job_id in self._waiting:
                self._started[job_id] = pid
                self._changed.notify_all()
                return
            self.discarded.append(pid)
        # Its fork already failed: nobody would wait for this rank, collect its result or
        # kill it, and it would run its job beside the next one (a rank in its own session).
        print(f"node {self.node}'s fork server started rank {pid} for job {job_id} after "
              f"its fork gave up; killed it", file=sys.stderr)
        for kill in (os.kill, os.killpg):  # it may not have its own session yet
            try:
                kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def fork(self, job_path: str, module: str, env: dict, log_path: str,
             netns: str | None = None) -> int:
        """Fork a rank that runs ``bednodes`` job ``job_path`` (its function in ``module``)
        with environment ``env`` and output to ``log_path``, in the network namespace
        ``netns`` (a path such as ``/run/netns/NAME``; ``None``: the server's); returns its
        pid."""
        return self._fork({"job": job_path, "module": module, "env": env, "log": log_path,
                           "netns": netns})

    def run_script(self, argv: list[str], module: str, env: dict, log_path: str) -> int:
        """Fork a process that runs the script ``argv[0]`` (its module ``module``, imported
        here first) as ``python ARGV...`` would, with environment ``env`` and output to
        ``log_path``; returns its pid."""
        return self._fork({"argv": [str(a) for a in argv], "module": module, "env": env,
                           "log": log_path})

    def _fork(self, job: dict) -> int:
        with self._changed:
            self._next_id += 1
            job_id = self._next_id
            self._waiting.add(job_id)
        line = json.dumps({**job, "id": job_id})
        try:
            with self._one_job:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the server is gone: its reader says so
        with self._changed:
            self._changed.wait_for(lambda: job_id in self._started or self._closed,
                                   START_TIMEOUT)
            self._waiting.discard(job_id)  # from now on, its line is a late one
            pid = self._started.pop(job_id, None)
        if pid is None:
            raise RuntimeError(f"node {self.node}'s fork server forked no rank within "
                               f"{START_TIMEOUT:.0f}s (exit code {self.proc.poll()}); see "
                               f"{self.log_path}")
        return pid

    def wait(self, pid: int, timeout: float) -> int | None:
        """The exit code of rank ``pid``; ``None`` if it did not end within ``timeout`` (or
        the server is gone and cannot tell)."""
        with self._changed:
            self._changed.wait_for(lambda: pid in self._exits or self._closed, timeout)
            return self._exits.get(pid)

    def exited(self, pid: int) -> bool:
        """Whether rank ``pid`` ended (and was reaped: its pid may belong to anyone now)."""
        with self._changed:
            return pid in self._exits

    def gone(self) -> str | None:
        """Why this node's server cannot report ranks any more (None while it runs)."""
        with self._changed:
            if not self._closed:
                return None
        return (f"node {self.node}'s fork server exited (code {self.proc.poll()}); see "
                f"{self.log_path}")

    def close(self) -> None:
        """Stop the server (its end of input); the ranks it forked are not waited for."""
        if self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


# ---------------------------------------------------------------- inside the node

def _serve() -> int:
    sys.path[:0] = RANK_PATH
    import torch  # noqa: F401  (the point of this process: imported once, before any fork)
    import torch.distributed  # noqa: F401

    import ckpt_client  # noqa: F401  (every rank function uses it: 0.7 s of CPU a rank)

    # SIGCHLD wakes the select below through this pipe; ranks are reaped as they end.
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    pending = b""
    while True:
        readable, _, _ = select.select([0, wake_r], [], [])
        if wake_r in readable:
            while True:
                try:
                    if not os.read(wake_r, 512):
                        break
                except BlockingIOError:
                    break
        _reap()
        if 0 in readable:
            data = os.read(0, 65536)
            if not data:  # nothing to flush or close: skip the interpreter's (torch's) exit
                os._exit(0)
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                job = json.loads(line)
                _preload(job["module"])
                pid = os.fork()
                if pid == 0:
                    _rank(job, (wake_r, wake_w))
                os.write(1, f"started {job['id']} {pid}\n".encode())


def _preload(module: str) -> None:
    # Every rank of a job imports its function's module; importing it here once is what
    # a fresh rank would do. One that fails to import fails in the rank, with its trace.
    try:
        importlib.import_module(module)
    except Exception:
        pass


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        os.write(1, f"exited {pid} {os.waitstatus_to_exitcode(status)}\n".encode())


def _rank(job: dict, server_fds: tuple) -> None:
    """In the forked child: become a rank as ``NetBed.popen`` would have started it."""
    code = 1
    try:
        if job.get("netns"):
            _enter_netns(job["netns"])
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(job["env"])
        if "argv" in job:
            code = _run_script(job["argv"])
        else:
            import bednodes

            code = bednodes._rank_main(job["job"])
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_script(argv: list[str]) -> int:
    """``python ARGV...`` from here on: the script as ``__main__`` (its directory first on
    the path), then what the interpreter does at exit (join the threads that are not
    daemons, run the exit handlers); returns the exit code."""
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    try:
        runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    return code


def _enter_netns(path: str) -> None:
    """Move this (single-threaded, just forked) process into the network namespace at
    ``path``, as ``ip netns exec`` does (Python 3.11 has no ``os.setns``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {path}: {os.strerror(error)}")
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(_serve())
