"""One rank against several ranks of a node saving through its one daemon at once.

The node's daemon serves every rank: on an 8-GPU node eight trainers hand it their
tensors in the same instant. For each rank count N, N real processes in a gloo group each
hold 1/N of the realistic ``training`` state (``workload.py``) on their device (with CUDA,
``cuda:<rank % devices>``; else the CPU) and, after a barrier, save it with
``ckpt_client.TorchAsyncCheckpoint`` together. Reported per N, as medians over the runs:

- the slowest rank's blocking time, and the same ranks' lower bound taken the same way
  (each rank copies its share into its own preallocated buffer at once: one non-blocking
  copy per tensor into page-locked memory and one synchronise on CUDA, memcpy on the
  CPU), and their ratio;
- the node's staging rate: the state's bytes over the slowest request's STAGE-to-staged
  time in the daemon's log (on CUDA: the daemon's device-to-host copies);
- the time until every rank's file is durable.

Usage::

    python benchmarks/bench_ranks.py --size-gib 2 --ranks 1,2,4,8 --out benchmarks/RESULTS_RANKS.md
    python benchmarks/bench_ranks.py --quick     # 64 MiB, ranks 1 and 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_save import (GB, STAGED_RE, GiB, Daemon, default_workdir, machine_facts,  # noqa: E402
                        on_device)
import methods as m  # noqa: E402
from procmem import loadavg  # noqa: E402
from report import write_report  # noqa: E402
import workload  # noqa: E402

#: Saves before the timed ones: a CUDA storage's first two saves export it afresh (the
#: daemon holds an export open once two saves in a row used it), later ones re-send the
#: held export and reuse the daemon's copy views; a training job lives in that state.
WARMUPS = 2


def worker(args: argparse.Namespace) -> None:
    """One rank: build its share, then time ``repeats`` bound copies and saves."""
    import torch.distributed as dist

    import ckpt_client

    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                            world_size=args.world)
    device = "cpu"
    if torch.cuda.is_available() and not args.cpu:
        device = f"cuda:{args.rank % torch.cuda.device_count()}"
        torch.cuda.set_device(device)
    state, _ = workload.build("training", args.share, device="cpu")
    state = on_device(state, device)
    copy = m.PreallocatedCopy(workload.tensors_of(state))
    copy.prepare()
    checkpoint = ckpt_client.TorchAsyncCheckpoint()
    path = os.path.join(args.outdir, f"rank{args.rank}.pt")
    runs = []
    try:
        for run in range(args.repeats + WARMUPS):
            # On a VM the first touches of memory freed by an earlier process can be several
            # times slower (the host backs the pages again): the warm-up copies thrice.
            for _ in range(1 if run else 3):
                dist.barrier()
                t0 = time.perf_counter()
                copy.start("")
                bound = time.perf_counter() - t0
            dist.barrier()
            t0 = time.perf_counter()
            checkpoint.async_save(state, path)
            blocking = time.perf_counter() - t0
            checkpoint.finalize_async_save(blocking=True)
            durable = time.perf_counter() - t0
            if run >= WARMUPS:
                runs.append({"bound_s": bound, "blocking_s": blocking, "durable_s": durable})
    finally:
        checkpoint.close()
        copy.close()
    with open(args.result, "w") as f:
        json.dump({"rank": args.rank, "device": device, "runs": runs}, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(ranks: int, total: int, daemon: Daemon, args: argparse.Namespace,
            workdir: str) -> dict:
    """Start ``ranks`` workers on ``total`` bytes between them; their combined figures."""
    rundir = tempfile.mkdtemp(prefix=f"bench-ranks-{ranks}-", dir=workdir)
    results = [os.path.join(rundir, f"result{r}.json") for r in range(ranks)]
    log_at = daemon.log_offset()
    procs = [subprocess.Popen([
        sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(r),
        "--world", str(ranks), "--store", os.path.join(rundir, "store"),
        "--share", str(total // ranks), "--repeats", str(args.repeats),
        "--outdir", rundir, "--result", results[r]] + (["--cpu"] if args.cpu else []))
        for r in range(ranks)]
    try:
        codes = [p.wait(timeout=3600) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"a worker of the {ranks}-rank run failed: exit codes {codes}")
    per_rank = []
    for path in results:
        with open(path) as f:
            per_rank.append(json.load(f))
    m.remove_tree(rundir)
    staged = [float(x) for x, _ in STAGED_RE.findall(daemon.log_since(log_at))]
    staged = staged[ranks * WARMUPS:]
    per_run = [staged[i:i + ranks] for i in range(0, len(staged), ranks)]

    def slowest(key: str) -> list[float]:
        return [max(r["runs"][i][key] for r in per_rank) for i in range(args.repeats)]

    blocking, bound, durable = slowest("blocking_s"), slowest("bound_s"), slowest("durable_s")
    stage = statistics.median([max(run) for run in per_run if len(run) == ranks]) \
        if per_run else None
    return {"ranks": ranks, "device": per_rank[0]["device"], "bytes_per_rank": total // ranks,
            "blocking_s": statistics.median(blocking), "bound_s": statistics.median(bound),
            "ratio": statistics.median(blocking) / statistics.median(bound),
            "best_ratio": min(blocking) / min(bound),
            "durable_s": statistics.median(durable), "staging_s": stage,
            "staging_gbps": total / stage / GB if stage else None,
            "blocking_runs": [round(x, 4) for x in blocking],
            "bound_runs": [round(x, 4) for x in bound]}


def render(report: dict) -> str:
    """The Markdown report."""
    facts = report["facts"]
    lines = ["# ckptd: one rank against several ranks per node", "",
             f"Measured {report['date']} by `{report['command']}` ({report['wall_s']:.0f} s).",
             "", f"- Machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}; "
             f"checkpoints on {facts['disk']}; load {report['load_start']} → "
             f"{report['load_end']}.",
             *([f"- GPU: {facts['gpu']}."] if facts.get("gpu") else []),
             f"- State: the `training` workload, {report['total_bytes'] / GiB:.3f} GiB in all, "
             f"split evenly over the ranks; {report['repeats']} timed runs after {WARMUPS} "
             "warm-ups (medians).", "",
             "| ranks | device | GiB per rank | slowest rank blocks s | bound s (all ranks "
             "copying at once) | blocking / bound (ratio of medians) | best / best | node staging "
             "GB/s | all durable s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        stage = f"{r['staging_gbps']:.2f}" if r["staging_gbps"] else "–"
        lines.append(f"| {r['ranks']} | {r['device']} | {r['bytes_per_rank'] / GiB:.3f} | "
                     f"{r['blocking_s']:.3f} | {r['bound_s']:.3f} | **{r['ratio']:.2f}×** | "
                     f"{r['best_ratio']:.2f}× | {stage} | {r['durable_s']:.3f} |")
    lines += ["", "Per-run slowest-rank times (s): " + "; ".join(
        f"{r['ranks']} rank(s): blocking {r['blocking_runs']}, bound {r['bound_runs']}"
        for r in report["rows"]) + "."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="the whole state (all ranks)")
    p.add_argument("--ranks", default="1,2,4", help="rank counts to compare (default 1,2,4)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--cpu", action="store_true", help="keep the state on the CPU even with CUDA")
    p.add_argument("--quick", action="store_true", help="64 MiB, ranks 1 and 2, 2 runs")
    p.add_argument("--out", default=None, help="write the Markdown report (and .json) here")
    p.add_argument("--workdir", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("--rank", "--world", "--share"):
        p.add_argument(name, type=int, help=argparse.SUPPRESS)
    for name in ("--store", "--outdir", "--result"):
        p.add_argument(name, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.quick:
        args.size_gib, args.ranks, args.repeats = 1 / 16, "1,2", min(args.repeats, 2)
    workdir = args.workdir or default_workdir()
    total = int(args.size_gib * GiB)
    started = time.time()
    outdir = tempfile.mkdtemp(prefix="bench-ranks-out-", dir=workdir)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
              "facts": machine_facts(outdir), "load_start": loadavg(), "repeats": args.repeats,
              "total_bytes": total, "rows": []}
    pool = -(-int(1.1 * total) // (1 << 20)) << 20  # every rank's share at once, whole MiB
    daemon = Daemon(outdir, pool, args.writers)
    try:
        for ranks in (int(n) for n in args.ranks.split(",")):
            print(f"{ranks} rank(s) ...", flush=True)
            row = measure(ranks, total, daemon, args, outdir)
            print(f"  slowest rank blocks {row['blocking_s']:.3f}s = {row['ratio']:.2f}x the "
                  f"bound; staging {row['staging_gbps'] or 0:.2f} GB/s", flush=True)
            report["rows"].append(row)
    finally:
        daemon.stop()
        m.remove_tree(outdir)
    report["load_end"], report["wall_s"] = loadavg(), time.time() - started
    text = render(report)
    write_report(args.out, text, report)
    if not args.out:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
