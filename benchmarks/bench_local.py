"""Local checkpoints with peer replication: what replication costs, and how fast a lost
node's parts come back (issue 3's benchmark).

Two "nodes" on one machine: two real ``ckptd serve`` daemons, each with its own
``--local-dir`` and ``--peer-listen`` on its own loopback address (127.0.0.1, 127.0.0.2),
and two trainer ranks (spawned processes in a real gloo group), rank r on node r. Each
rank saves a part of ``--part-mib`` MiB (the mix of ``workload.py``) through
``ckpt_client.LocalCheckpointManager``:

1. **Replication cost**: the same part saved with ``repl_strategy=None`` and with
   ``CliqueReplicationStrategy.from_replication_params(1, 2)`` (replication factor 2: each
   part also goes to the other node's daemon), alternating the two so load drift hits
   both alike. Blocking time (``save(..., is_async=True)`` returns) and time to durable
   (``maybe_finalize_async_calls(blocking=True)`` returns: local part durable, replica
   durable on the peer, iteration committed), slowest rank; ratio repl / no-repl.
2. **Restore**: node 1's daemon is stopped, its local directory wiped, and the daemon
   started again; both ranks run ``find_latest`` + ``load``. Rank 1's ``load`` fetches its
   part from node 0's daemon (CURVE over loopback tcp, verified, written durably) and
   reads it; rank 0's ``load`` reads its own part locally (for contrast).
3. **Raw loopback throughput** for the same number of bytes: a plain TCP socket and
   ZeroMQ PUSH/PULL (without and with CURVE), 4 MiB frames, receiver in another process.

Usage::

    python benchmarks/bench_local.py --part-mib 256 --repeats 3 --out benchmarks/RESULTS_LOCAL.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from report import stop_daemon, write_report

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MiB = 1 << 20
FRAME = 4 * MiB
SESSION_PLAIN = "norepl"
SESSION_REPL = "repl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


# ---------------------------------------------------------------- nodes

class Node:
    """One "node": a ckptd daemon with a local dir and a peer address."""

    def __init__(self, index: int, base: str, pool_size: int) -> None:
        self.index = index
        self.local_dir = os.path.join(base, f"node{index}")
        self.address = f"tcp://127.0.0.{index + 1}:{free_port()}"
        self.pool_size = pool_size
        self.rundir = tempfile.mkdtemp(prefix=f"ckptd-node{index}-")
        self.socket = os.path.join(self.rundir, "ckptd.sock")
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        os.makedirs(self.local_dir, exist_ok=True)
        log = open(os.path.join(self.rundir, "ckptd.log"), "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", self.socket,
             "--root", self.local_dir, "--local-dir", self.local_dir,
             "--peer-listen", self.address, "--pool-size", str(self.pool_size),
             "--writers", "2"], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        ready = os.path.join(self.rundir, "ckptd.ready")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.index}'s ckptd exited; see {self.rundir}/ckptd.log")
            try:
                with open(ready) as f:
                    if json.load(f).get("pid") == self.proc.pid:
                        return
            except (FileNotFoundError, ValueError):
                pass
            time.sleep(0.05)  # polling the ready file the daemon writes atomically
        raise RuntimeError(f"node {self.index}'s ckptd not ready in 120 s")

    def stop(self) -> None:
        if self.proc is not None:
            stop_daemon(self.proc)

    def lose_disk_and_restart(self) -> None:
        self.stop()
        shutil.rmtree(self.local_dir, ignore_errors=True)
        self.start()


# ---------------------------------------------------------------- rank processes

def _rank_main(phase: str, rank: int, world: int, store: str, sock: str, root: str,
               opts: dict, results) -> None:
    os.environ["CKPTD_SOCKET"] = sock
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn = _save_phase if phase == "save" else _restore_phase
        results.put((rank, fn(rank, root, opts), None))
    except BaseException as exc:  # reported to the parent
        import traceback

        results.put((rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def _slowest(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _save_phase(rank: int, root: str, opts: dict) -> dict:
    import torch.distributed as dist

    import workload
    from ckpt_client import (AsyncCallsQueue, BasicTensorAwareStateDict,
                             CliqueReplicationStrategy, LocalCheckpointManager)

    state, mix = workload.build_state_dict(opts["part_bytes"], seed=rank)
    managers = {
        SESSION_PLAIN: LocalCheckpointManager(root, session_id=SESSION_PLAIN),
        SESSION_REPL: LocalCheckpointManager(
            root, session_id=SESSION_REPL,
            repl_strategy=CliqueReplicationStrategy.from_replication_params(1, 2)),
    }
    queue = AsyncCallsQueue()
    runs: dict = {SESSION_PLAIN: [], SESSION_REPL: []}
    reports: list = []
    for iteration in range(opts["repeats"] + 1):  # iteration 0 is the warm-up
        for session, manager in managers.items():
            dist.barrier()
            t0 = time.perf_counter()
            request = manager.save(BasicTensorAwareStateDict(state), iteration, is_async=True)
            t1 = time.perf_counter()
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            t2 = time.perf_counter()
            blocking, durable = _slowest(t1 - t0), _slowest(t2 - t0)
            if iteration > 0:
                runs[session].append((blocking, durable))
                if session == SESSION_REPL:
                    reports.append(manager.last_save_report)
    queue.close()
    return {"part_bytes": mix.total_bytes, "runs": runs, "reports": reports}


def _restore_phase(rank: int, root: str, opts: dict) -> dict:
    import torch.distributed as dist

    from ckpt_client import CliqueReplicationStrategy, LocalCheckpointManager

    manager = LocalCheckpointManager(
        root, session_id=SESSION_REPL,
        repl_strategy=CliqueReplicationStrategy.from_replication_params(1, 2))
    latest = manager.find_latest()
    dist.barrier()
    t0 = time.perf_counter()
    loaded, part_id = manager.load()
    load_s = time.perf_counter() - t0
    nbytes = sum(t.nbytes for group in ("model", "buffers")
                 for t in loaded.state_dict[group].values())
    return {"latest": latest, "part_id": list(part_id), "load_s": load_s, "bytes": nbytes,
            "report": manager.last_load_report}


def run_ranks(phase: str, nodes: list[Node], workdir: str, opts: dict,
              timeout: float = 900.0) -> list:
    """Run ``phase`` on one rank per node; returns each rank's result (rank order)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    store = os.path.join(workdir, f"{phase}-{time.monotonic_ns()}-store")
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(phase, r, len(nodes), store, n.socket,
                               os.path.join(n.local_dir, "ckpt"), opts, results))
             for r, n in enumerate(nodes)]
    for p in procs:
        p.start()
    out: dict = {}
    deadline = time.monotonic() + timeout
    while len(out) < len(procs):
        if time.monotonic() > deadline:
            break
        try:
            rank, value, error = results.get(timeout=1.0)
        except Exception:  # queue.Empty: check for dead ranks
            if any(not p.is_alive() and p.exitcode for p in procs):
                break
            continue
        if error:
            for p in procs:
                p.kill()
            raise RuntimeError(f"rank {rank} failed in {phase}: {error}")
        out[rank] = value
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    if len(out) < len(procs):
        raise RuntimeError(f"{phase}: ranks {sorted(set(range(len(procs))) - set(out))} "
                           "returned nothing")
    return [out[r] for r in range(len(procs))]


# ---------------------------------------------------------------- raw loopback

def _receiver(kind: str, address: str, nbytes: int, keys: tuple, ready) -> None:
    if kind == "tcp":
        with socket.socket() as srv:
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            host, port = address.rsplit(":", 1)
            srv.bind((host, int(port)))
            srv.listen(1)
            ready.set()
            conn, _ = srv.accept()
            buf = bytearray(FRAME)
            got = 0
            with conn:
                while got < nbytes:
                    n = conn.recv_into(buf)
                    if not n:
                        break
                    got += n
                conn.sendall(b"k")
        return
    import zmq

    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    if keys:
        pull.curve_server = True
        pull.curve_secretkey = keys[1]
        pull.curve_publickey = keys[0]
    pull.bind(f"tcp://{address}")
    ack = ctx.socket(zmq.PUSH)
    ack.bind(f"tcp://{address.rsplit(':', 1)[0]}:{int(address.rsplit(':', 1)[1]) + 1}")
    ready.set()
    got = 0
    while got < nbytes:
        got += len(pull.recv(copy=False).buffer)
    ack.send(b"k")
    pull.close()
    ack.close()
    ctx.term()


def loopback(kind: str, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over loopback with ``kind`` (tcp, zmq, zmq+curve)."""
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    while True:  # zmq variants need port + 1 free too
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.2", port + 1))
            break
        except OSError:
            port = free_port()
    address = f"127.0.0.2:{port}"
    keys: tuple = ()
    client_keys: tuple = ()
    if kind == "zmq+curve":
        import zmq

        keys = zmq.curve_keypair()
        client_keys = zmq.curve_keypair()
    ready = ctx.Event()
    proc = ctx.Process(target=_receiver, args=(kind.split("+")[0], address, nbytes, keys, ready))
    proc.start()
    ready.wait(60)
    payload = memoryview(bytearray(os.urandom(1 << 20)) * (FRAME // (1 << 20)))
    if kind == "tcp":
        with socket.create_connection(("127.0.0.2", port)) as s:
            t0 = time.perf_counter()
            sent = 0
            while sent < nbytes:
                chunk = payload[:min(FRAME, nbytes - sent)]
                s.sendall(chunk)
                sent += len(chunk)
            s.recv(1)
            elapsed = time.perf_counter() - t0
    else:
        import zmq

        zctx = zmq.Context()
        push = zctx.socket(zmq.PUSH)
        if keys:
            push.curve_serverkey = keys[0]
            push.curve_publickey, push.curve_secretkey = client_keys
        push.connect(f"tcp://{address}")
        ack = zctx.socket(zmq.PULL)
        ack.connect(f"tcp://127.0.0.2:{port + 1}")
        t0 = time.perf_counter()
        sent = 0
        while sent < nbytes:
            chunk = payload[:min(FRAME, nbytes - sent)]
            push.send(chunk, copy=False)
            sent += len(chunk)
        ack.recv()
        elapsed = time.perf_counter() - t0
        push.close()
        ack.close()
        zctx.term()
    proc.join(30)
    return elapsed


# ---------------------------------------------------------------- report

def render(report: dict) -> str:
    part = report["part_bytes"]
    plain = report["save"][SESSION_PLAIN]
    repl = report["save"][SESSION_REPL]
    med = statistics.median
    pb, pd = med([b for b, _ in plain]), med([d for _, d in plain])
    rb, rd = med([b for b, _ in repl]), med([d for _, d in repl])
    paired = med([r[1] / p[1] for p, r in zip(plain, repl)])
    lines = [
        "# ckptd local checkpoints: replication and restore", "",
        f"Measured {report['date']} by `{report['command']}`; 2 nodes (2 ckptd daemons on "
        "127.0.0.1 / 127.0.0.2, 2 writers each) x 1 rank, world size 2, replication factor 2 "
        f"(clique (0, 1)); part {part / MiB:.0f} MiB per rank. Load average at start "
        f"{report['load_start']}, at end {report['load_end']}; {os.cpu_count()} cores shared by "
        "both nodes, both ranks and other engineers' tests.", "",
        "## Save: replication factor 2 against none", "",
        "| save | blocking s | durable s (slowest rank) | GB/s per rank |",
        "|---|---|---|---|",
        f"| no replication | {pb:.3f} | {pd:.3f} | {part / pd / 1e9:.2f} |",
        f"| replication factor 2 | {rb:.3f} | {rd:.3f} | {part / rd / 1e9:.2f} |", "",
        f"Time to durable, replicated / not: **{rd / pd:.2f}×** of the medians, "
        f"{paired:.2f}× median of paired runs (target SPEC §6: ≤ 1.30×). Runs (blocking, "
        f"durable): none {[(round(b, 3), round(d, 3)) for b, d in plain]}; factor 2 "
        f"{[(round(b, 3), round(d, 3)) for b, d in repl]}.",
        f"Save reports: {report['save_reports'][-1] if report['save_reports'] else '–'}.", "",
        "## Restore of a lost node's part from its peer", ""]
    fetch = [r[1]["load_s"] for r in report["restore"]]
    local = [r[0]["load_s"] for r in report["restore"]]
    lines += [
        "| path | seconds (median) | GB/s | runs |", "|---|---|---|---|",
        f"| rank 1 `load()` after node 1 lost its disk (fetch from node 0 + verify + write + "
        f"read) | {med(fetch):.3f} | {part / med(fetch) / 1e9:.2f} | {[round(x, 3) for x in fetch]} |",
        f"| rank 0 `load()` of its own local part | {med(local):.3f} | "
        f"{part / med(local) / 1e9:.2f} | {[round(x, 3) for x in local]} |"]
    for kind, times in report["loopback"].items():
        lines.append(f"| raw loopback {kind}, {part / MiB:.0f} MiB in 4 MiB frames | "
                     f"{med(times):.3f} | {part / med(times) / 1e9:.2f} | "
                     f"{[round(x, 3) for x in times]} |")
    tcp = med(report["loopback"]["tcp"])
    lines += ["", f"Restore / raw tcp loopback: **{med(fetch) / tcp:.1f}×** the time "
                  f"({part / med(fetch) / 1e9:.2f} vs {part / tcp / 1e9:.2f} GB/s). Load reports "
                  f"of rank 1: {[r[1]['report'] for r in report['restore']]}.", ""]
    return "\n".join(lines)


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)  # also when started in the background
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part-mib", type=int, default=256, help="part size per rank (MiB)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="Markdown report (and .json beside)")
    p.add_argument("--workdir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ckpt-local-bench-", dir=args.workdir)
    part = args.part_mib * MiB
    pool = 3 * part + 64 * MiB
    report: dict = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
                    "load_start": loadavg()}
    nodes: list[Node] = []
    try:
        nodes = [Node(i, base, pool) for i in range(2)]
        opts = {"part_bytes": part, "repeats": args.repeats}
        print("save phase ...", flush=True)
        saved = run_ranks("save", nodes, base, opts)
        report["part_bytes"] = saved[0]["part_bytes"]
        report["save"] = saved[0]["runs"]
        report["save_reports"] = saved[0]["reports"]
        report["restore"] = []
        for i in range(args.repeats):
            print(f"restore {i} ...", flush=True)
            nodes[1].lose_disk_and_restart()
            report["restore"].append(run_ranks("restore", nodes, base, opts))
        print("loopback ...", flush=True)
        report["loopback"] = {k: [loopback(k, report["part_bytes"]) for _ in range(args.repeats)]
                              for k in ("tcp", "zmq", "zmq+curve")}
    finally:
        for node in nodes:
            node.stop()
            shutil.rmtree(node.rundir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    report["load_end"] = loadavg()
    text = render(report)
    print(text)
    write_report(args.out, text, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
