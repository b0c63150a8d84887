"""ckptd "nodes" in a network-namespace bed: a daemon per node, trainer ranks inside nodes.

Each node of a :class:`netbed.NetBed` gets a real ``ckptd serve`` started inside its
namespace, with ``--local-dir`` on the node's own tmpfs and ``--peer-listen
tcp://0.0.0.0:PORT`` (so the daemon must advertise its node's interface address; the
loopback fallback binds each node's own 127.77.x.y instead). Ranks are separate Python
processes forked by one server of this test process that imported torch once
(``tests/nodeforks.py``), each entering its node's network namespace first, with
``GLOO_SOCKET_IFNAME`` and a rendezvous on rank 0's node
(:meth:`netbed.NetBed.rank_env`): gloo, the daemon socket and replication all cross the
bed as they would cross a cluster.

A rank runs ``module:function(rank, world_size, *args)`` (module-level functions of the
tests or benchmarks) and leaves its outcome, pickled, in a file; nothing is mocked. Used
by ``tests/integration/test_local_netbed.py`` and ``benchmarks/bench_local.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

from ckptd.protocol import wait_until_ready
from nodeforks import RANK_PATH, ROOT, TESTS_DIR, HostPopen, NodeForkServer

READY_TIMEOUT = 120.0
_forks: NodeForkServer | None = None
_forks_lock = threading.Lock()


def fork_server() -> NodeForkServer:
    """This process's fork server, shared by every bed: started by the first ranks (or
    again if it died), stopped when this process exits."""
    global _forks
    with _forks_lock:
        if _forks is None or _forks.gone():
            if _forks is None:
                atexit.register(lambda: _forks and _forks.close())
            log = os.path.join(tempfile.gettempdir(), f"bednodes-forks-{os.getpid()}.log")
            _forks = NodeForkServer(HostPopen(), 0, log)
        return _forks


@dataclass
class Outcome:
    """What one rank returned (or raised, as text)."""

    rank: int
    value: object = None
    error: str | None = None


class BedNodes:
    """One ckptd per node of ``bed`` (see the module docstring).

    Parameters
    ----------
    bed : netbed.NetBed
        A bed that is up.
    workdir : str
        Where sockets, logs and rank files go (outside the nodes' tmpfs).
    env : dict, optional
        Environment of the daemons (knobs such as ``CKPTD_PEER_TIMEOUT``).
    pool_size : str
        ``--pool-size`` of each daemon.
    extra_args : list, optional
        More ``ckptd serve`` options for every daemon.
    """

    def __init__(self, bed, workdir: str, env: dict | None = None, pool_size: str = "128M",
                 writers: int = 2, extra_args: list | None = None) -> None:
        self.bed, self.workdir = bed, workdir
        self.env, self.pool_size, self.writers = dict(env or {}), pool_size, writers
        self.extra_args = list(extra_args or [])
        self.listen = [self._listen_address(i) for i in range(len(bed.nodes))]
        self.procs: list = [None] * len(bed.nodes)
        self.started: list = []
        # Started together, then waited for: on a 32-node bed one at a time takes long.
        for i in range(len(bed.nodes)):
            self.launch(i)
        for i in range(len(bed.nodes)):
            self.wait_ready(i)

    def _listen_address(self, i: int) -> str:
        port = self.bed.free_port(i)
        host = "0.0.0.0" if self.bed.mode == "netns" else self.bed.nodes[i].ip
        return f"tcp://{host}:{port}"

    # ------------------------------------------------------------ daemons
    def run_dir(self, i: int) -> str:
        return os.path.join(self.workdir, f"run-n{i}")

    def socket(self, i: int) -> str:
        return os.path.join(self.run_dir(i), "ckptd.sock")

    def log_path(self, i: int) -> str:
        return os.path.join(self.workdir, f"ckptd-n{i}.log")

    def log(self, i: int) -> str:
        with open(self.log_path(i), errors="replace") as f:
            return f.read()

    def start(self, i: int) -> None:
        """Start node ``i``'s daemon and wait for its ready file."""
        self.launch(i)
        self.wait_ready(i)

    def launch(self, i: int) -> None:
        """Start node ``i``'s daemon (:meth:`wait_ready` waits for it)."""
        node = self.bed.nodes[i]
        os.makedirs(self.run_dir(i), exist_ok=True)
        command = [sys.executable, "-m", "ckptd", "serve", "--socket", self.socket(i),
                   "--root", node.local_dir, "--local-dir", node.local_dir,
                   "--peer-listen", self.listen[i], "--pool-size", self.pool_size,
                   "--writers", str(self.writers), *self.extra_args]
        with open(self.log_path(i), "ab") as log:
            proc = self.bed.popen(i, command, stdout=log, stderr=subprocess.STDOUT,
                                  env={**self.env, "PYTHONPATH": ROOT})
        self.procs[i] = proc
        self.started.append(proc)

    def wait_ready(self, i: int) -> None:
        """Wait for node ``i``'s daemon's ready file (failing with its log if it exits)."""
        problem = wait_until_ready(self.socket(i), self.procs[i], READY_TIMEOUT)
        if problem:
            raise RuntimeError(f"node {i}'s ckptd {problem}:\n{self.log(i)}")

    def kill(self, i: int, wipe: bool = False) -> None:
        """SIGKILL node ``i``'s daemon (its writers die with it); ``wipe`` also empties its
        local directory, as a node that lost its disk."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(60)
        _remove_pool_of(proc.pid)
        if wipe:
            local = self.bed.nodes[i].local_dir
            for name in os.listdir(local):
                path = os.path.join(local, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)

    def restart(self, i: int, wipe: bool = False) -> None:
        """Kill node ``i``'s daemon (optionally losing its disk) and start it again."""
        self.kill(i, wipe)
        self.start(i)

    def stop_all(self) -> None:
        """Stop every daemon ever started here (the bed kills what is left, the ranks
        included)."""
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
            _remove_pool_of(proc.pid)

    def status(self, i: int) -> dict:
        """Node ``i``'s status document (the socket is a file: reachable from here)."""
        from ckptd.status import query_status

        code, doc, why = query_status(self.socket(i), timeout=10)
        if code != 0:
            raise RuntimeError(f"node {i}: {why}")
        return doc

    def address(self, i: int) -> str:
        """Node ``i``'s advertised peer address."""
        return self.status(i)["replication"]["address"]

    def root(self, i: int) -> str:
        """The ``root_local_ckpt_dir`` ranks of node ``i`` use."""
        return os.path.join(self.bed.nodes[i].local_dir, "ckpt")

    def part(self, node: int, session: str, iteration: int, owner: int) -> str:
        """Where node ``node`` keeps ``owner``'s part of ``iteration``."""
        return os.path.join(self.root(node), session, f"iter_{iteration:07d}",
                            f"rank_{owner}.part")

    # ------------------------------------------------------------ ranks
    def run_ranks(self, fn, placement: list[int], args=(), timeout: float = 300.0,
                  name: str = "pg") -> list[Outcome]:
        """Run ``fn(rank, world_size, *args)`` on rank ``r`` inside node ``placement[r]``."""
        world = len(placement)
        port = self.bed.free_port(placement[0])
        forks = fork_server()
        pids, results = [], []
        for rank, node in enumerate(placement):
            job = os.path.join(self.workdir, f"{name}-rank{rank}.job")
            result = os.path.join(self.workdir, f"{name}-rank{rank}.out")
            if os.path.exists(result):
                os.unlink(result)
            with open(job, "wb") as f:
                pickle.dump({"module": fn.__module__, "function": fn.__name__, "rank": rank,
                             "world": world, "args": args, "result": result}, f)
            env = {**os.environ,  # rank_env includes the node's own environment
                   **self.bed.rank_env(node, rank, world, port, master=placement[0]),
                   "CKPTD_SOCKET": self.socket(node), "PYTHONPATH": ROOT,
                   "CKPTD_AUTO_START": "0"}
            ns = self.bed.nodes[node].ns
            pids.append(forks.fork(job, fn.__module__, env,
                                   os.path.join(self.workdir, f"{name}-rank{rank}.log"),
                                   netns=f"/run/netns/{ns}" if ns else None))
            results.append(result)
        deadline = time.monotonic() + timeout
        codes = []
        for rank, pid in enumerate(pids):
            codes.append(forks.wait(pid, max(1.0, deadline - time.monotonic())))
            if codes[-1] is None:
                for other in pids:
                    # a rank that ended was reaped: its pid may be another process's now
                    if not forks.exited(other):
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(other, signal.SIGKILL)
                server = forks.gone()
                raise AssertionError(f"{name}: " + (f"{server}; rank {rank} was not reported"
                                                    if server else
                                                    f"ranks gave no result within "
                                                    f"{timeout:.0f}s") +
                                     f"; see {self.workdir}/{name}-rank*.log")
        outcomes = []
        for rank, result in enumerate(results):
            try:
                with open(result, "rb") as f:
                    outcomes.append(pickle.load(f))
            except FileNotFoundError:
                with open(os.path.join(self.workdir, f"{name}-rank{rank}.log"), "rb") as f:
                    tail = f.read()[-3000:].decode(errors="replace")
                outcomes.append(Outcome(rank, error=f"exited {codes[rank]} without "
                                                    f"a result:\n{tail}"))
        return outcomes


def values(outcomes: list[Outcome]) -> list:
    """The ranks' return values, failing with every rank's error if any raised."""
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error]
    assert not errors, "\n".join(errors)
    return [o.value for o in outcomes]


def _remove_pool_of(pid: int) -> None:
    # A SIGKILLed daemon cannot unlink its pool; tests must not leak /dev/shm.
    for name in os.listdir("/dev/shm"):
        if name.startswith(f"ckptd-{os.getuid()}-{pid}-"):
            os.unlink(os.path.join("/dev/shm", name))


def _rank_main(job_path: str) -> int:
    """Inside a node: join the gloo group, run the function, leave the outcome."""
    with open(job_path, "rb") as f:
        job = pickle.load(f)
    sys.path[:0] = RANK_PATH
    import datetime
    import importlib

    import torch
    import torch.distributed as dist

    import bednodes  # this file as a module: its Outcome must unpickle in the parent

    torch.set_num_threads(1)
    rank, world = job["rank"], job["world"]
    outcome = bednodes.Outcome(rank)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        try:
            fn = getattr(importlib.import_module(job["module"]), job["function"])
            outcome.value = fn(rank, world, *job["args"])
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, which decides
        outcome.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    tmp = job["result"] + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(outcome, f)
    os.replace(tmp, job["result"])
    return 0

