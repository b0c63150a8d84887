"""Tiered saves against a slow target, side by side with today's paths, in one run.

The "shared storage" is a FUSE passthrough (``tests/faultfs.py``) that sleeps per MiB
written, one stream at a time: a throttled target. Every method below writes to the target
through one stream, so the bound is the same throttle with nothing else saving: a raw
sequential write + fsync of the same bytes (``raw_target``); the FUSE layer's own CPU is in
the bound too. Methods, each on the same state dict (single rank, DCP format):

- ``tiered_fast``: ``ckptd serve --stage-dir`` with a fast target (a plain local directory);
- ``tiered_slow``: the same daemon, the throttled target;
- ``direct_slow``: a daemon without a stage directory writing straight to the throttled
  target (today's path, ``--writers 1``);
- ``stock_async_slow``: stock ``torch.distributed.checkpoint.async_save`` (FileSystemWriter,
  one thread) to the throttled target.

Per save: the trainer's blocking time (the ``async_save`` call), the duration of a fixed
CPU step run right after the call returns (the step that overlaps the save) against the
same step with nothing saving, time to locally durable (tiered: pool -> stage directory,
against ``raw_local``: a raw write + fsync of the same bytes into the stage directory), time
to durable at the target (call to finalize) against ``raw_target``, and the daemon's CPU
seconds per GB (its main process runs the flusher threads). Ratios are of medians; each
bound is reported with its spread (min-max).

Run under ``/work/bin/texcl`` as root (FUSE): ``python benchmarks/bench_tiered.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))

from faultfs import FaultFS, fuse_unavailable  # noqa: E402

MIB = 1 << 20


def state_dict(mib: int) -> dict:
    g = torch.Generator().manual_seed(0)
    per = 32
    return {f"layer{i}": torch.randn(per * MIB // 4, generator=g) for i in range(mib // per)}


def raw_write(directory: str, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially and fsync them (one stream, 8 MiB writes)."""
    path = os.path.join(directory, f"raw-{time.monotonic_ns()}")
    chunk = os.urandom(8 * MIB)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(nbytes // len(chunk)):
            f.write(chunk)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    os.unlink(path)
    return seconds


def step(a: torch.Tensor) -> float:
    """A fixed CPU training step stand-in; its duration."""
    start = time.perf_counter()
    for _ in range(20):
        a = torch.tanh(a @ a.T / a.shape[0])
    return time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_daemon(tmp: str, name: str, roots: list[str], extra: list[str], env: dict):
    socket = os.path.join(tmp, f"run-{name}", "ckptd.sock")
    log = open(os.path.join(tmp, f"{name}.log"), "wb")
    command = [sys.executable, "-m", "ckptd", "serve", "--socket", socket, "--pool-size", "1G",
               "--writers", "1", *extra]
    for root in roots:
        command += ["--root", root]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, **env, "PYTHONPATH": os.path.join(HERE, "..")})
    from ckptd import protocol

    problem = protocol.wait_until_ready(socket, process, 120)
    if problem:
        raise RuntimeError(f"daemon {name}: {problem}")
    return process, socket


def ckptd_save(socket: str, state: dict, path: str, work: torch.Tensor) -> dict:
    os.environ["CKPTD_SOCKET"] = socket
    from ckpt_client import AsyncCallsQueue
    from ckpt_client import dcp as ckpt_dcp
    from ckptd.status import query_status

    queue = AsyncCallsQueue()
    start = time.perf_counter()
    request = ckpt_dcp.async_save(state, path)
    blocking = time.perf_counter() - start
    queue.schedule_async_request(request)
    step_s = step(work)
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    durable = time.perf_counter() - start
    queue.close()
    _, doc, _ = query_status(socket, timeout=10)
    mine = [r for r in doc["requests"] if r["path"] == os.path.abspath(path)]
    local = None
    if mine and mine[-1].get("local_durable_at"):
        local = mine[-1]["local_durable_at"] - mine[-1]["staged_at"]
    return {"blocking_s": blocking, "step_s": step_s, "durable_s": durable, "local_s": local}


def stock_save(state: dict, path: str, work: torch.Tensor) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    start = time.perf_counter()
    future = dcp.async_save(state, storage_writer=FileSystemWriter(path, thread_count=1))
    blocking = time.perf_counter() - start
    step_s = step(work)
    future.result()
    return {"blocking_s": blocking, "step_s": step_s, "durable_s": time.perf_counter() - start,
            "local_s": None}


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values):
    return [min(values), max(values)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--target-mib-s", type=float, default=100.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=os.path.join(HERE, "..", ".bench-tiered"))
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS_TIERED.json"))
    args = parser.parse_args()
    if fuse_unavailable():
        sys.exit(fuse_unavailable())
    args.dir = os.path.abspath(args.dir)
    os.makedirs(args.dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tiered-", dir=args.dir)
    nbytes = args.mib * MIB
    state = state_dict(args.mib)
    work = torch.randn(384, 384)
    torch.set_num_threads(1)
    fs = FaultFS(os.path.join(tmp, "backing"), os.path.join(tmp, "slow"))
    fs.start()
    fast = os.path.join(tmp, "fast")
    stage = os.path.join(tmp, "stage")
    for d in (fast, stage):
        os.makedirs(d)
    daemons = []
    results: dict = {"mib": args.mib, "target_mib_s": args.target_mib_s, "reps": args.reps,
                     "torch": torch.__version__}
    try:
        fs.set(delay_per_mib=1.0 / args.target_mib_s, ops=["write"])
        bounds = {"raw_target": [], "raw_local": [], "step_idle": []}
        for _ in range(args.reps):
            bounds["raw_target"].append(raw_write(fs.mount, nbytes))
            bounds["raw_local"].append(raw_write(stage, nbytes))
            bounds["step_idle"].append(step(work))
        env = {"CKPTD_FLUSH_PARALLELISM": "1"}
        tiered, tiered_socket = start_daemon(tmp, "tiered", [fs.mount, fast],
                                             ["--stage-dir", stage], env)
        direct, direct_socket = start_daemon(tmp, "direct", [fs.mount], [], env)
        daemons += [tiered, direct]
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
        methods = {
            "tiered_fast": lambda i: ckptd_save(tiered_socket, state, f"{fast}/t{i}", work),
            "tiered_slow": lambda i: ckptd_save(tiered_socket, state, f"{fs.mount}/t{i}", work),
            "direct_slow": lambda i: ckptd_save(direct_socket, state, f"{fs.mount}/d{i}", work),
            "stock_async_slow": lambda i: stock_save(state, f"{fs.mount}/s{i}", work),
        }
        runs: dict = {name: [] for name in methods}
        for i in range(args.reps):
            for name, run in methods.items():  # interleaved: drift hits every method alike
                pid = tiered.pid if name.startswith("tiered") else direct.pid
                before = cpu_seconds(pid)
                outcome = run(i)
                outcome["daemon_cpu_s_per_gb"] = (cpu_seconds(pid) - before) / (nbytes / 1e9)
                runs[name].append(outcome)
                print(name, json.dumps(outcome), flush=True)
        results["bounds"] = {k: {"median": median(v), "spread": spread(v)}
                             for k, v in bounds.items()}
        results["methods"] = {name: {key: median([r[key] for r in rs]) for key in rs[0]}
                              for name, rs in runs.items()}
        results["runs"] = runs
        m, b = results["methods"], results["bounds"]
        results["ratios"] = {
            "tiered_slow_blocking_vs_tiered_fast": m["tiered_slow"]["blocking_s"]
            / m["tiered_fast"]["blocking_s"],
            "tiered_slow_step_vs_tiered_fast": m["tiered_slow"]["step_s"]
            / m["tiered_fast"]["step_s"],
            "tiered_slow_step_vs_idle_step": m["tiered_slow"]["step_s"] / b["step_idle"]["median"],
            "tiered_local_durable_vs_raw_local": m["tiered_slow"]["local_s"]
            / b["raw_local"]["median"],
            "tiered_target_durable_vs_raw_target": m["tiered_slow"]["durable_s"]
            / b["raw_target"]["median"],
            "direct_slow_blocking_vs_tiered_slow": m["direct_slow"]["blocking_s"]
            / m["tiered_slow"]["blocking_s"],
            "stock_async_slow_blocking_vs_tiered_slow": m["stock_async_slow"]["blocking_s"]
            / m["tiered_slow"]["blocking_s"],
        }
        print(json.dumps(results["ratios"], indent=2))
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    finally:
        for process in daemons:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        fs.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
