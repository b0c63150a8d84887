"""The default (uncached, blocking) DCP save on several gloo ranks: the call, before and after.

Each rank holds the ``training`` workload (``workload.py``) and runs
``ckpt_client.dcp.async_save`` (no cache) against one real ``ckptd serve`` started here,
alternating, save by save, the current planning and DCP's own planning calls
(``CKPTD_DCP_FAST_PLAN`` off: the code before its short route and packed plan
collectives; with ``--before copy-after-planning``, ``CKPTD_DCP_GUESS_PLAN`` off instead: the
copy after planning rather than beside it), so that drift in the machine's load falls on
both alike. The ranks meet in
a barrier before each save; then each copies its tensors into preallocated buffers (one
``torch._foreach_copy_``, after an untimed one): the memcpy bound of the same slot.
Reported per rank: median call (min–max), median bound (min–max), ratio of the medians.

Usage::

    python benchmarks/bench_dcp_ranks.py --ranks 2 --size-gib 0.25 --saves 8
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "tests")]

from ckptd.protocol import wait_until_ready  # noqa: E402
from multirank import run_ranks, values  # noqa: E402


#: --before: the knob each "before" save turns off, and the row's name.
BEFORE = {"own-planning": ("DCP_FAST_PLAN", "DCP's own (before)"),
          "copy-after-planning": ("DCP_GUESS_PLAN", "copy after planning (before)")}


def one_rank(rank: int, world: int, root: str, size_gib: float, saves: int,
             before: str = "own-planning") -> dict:
    import gc

    import torch
    import torch.distributed
    import workload
    from ckpt_client import AsyncCallsQueue, dcp
    from ckptd import knobs

    state, _ = workload.build("training", int(size_gib * (1 << 30)))
    tensors = workload.tensors_of(state)
    copies = [torch.empty_like(t) for t in tensors]
    queue = AsyncCallsQueue()
    runs: dict = {"after": [], "before": [], "bound": []}
    for number in range(saves + 1):
        for label, fast in (("after", True), ("before", False)):
            # every rank starts the call together (rank 0 removed the last checkpoint)
            torch.distributed.barrier()
            gc.collect()
            torch._foreach_copy_(copies, tensors)
            start = time.perf_counter()
            torch._foreach_copy_(copies, tensors)
            bound = time.perf_counter() - start
            path = os.path.join(root, f"{label}{number}")
            with knobs.override(**{BEFORE[before][0]: fast}):
                start = time.perf_counter()
                request = dcp.async_save(state, path)
                call = time.perf_counter() - start
            queue.schedule_async_request(request)
            queue.maybe_finalize_async_calls(blocking=True)
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            if number:  # the first round warms up
                runs[label].append(call)
                runs["bound"].append(bound)
    queue.close()
    return {"runs": runs, "tensors": len(tensors)}


def spread(runs: list) -> str:
    return f"{statistics.median(runs) * 1e3:.1f} ({min(runs) * 1e3:.1f}–{max(runs) * 1e3:.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--size-gib", type=float, default=0.25, help="state per rank")
    parser.add_argument("--saves", type=int, default=8, help="timed saves of each kind")
    parser.add_argument("--before", choices=sorted(BEFORE), default="own-planning",
                        help="what the alternated 'before' saves turn off")
    args = parser.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ckpt-bench-ranks-"))
    root = tmp / "root"
    root.mkdir()
    pool = int(args.size_gib * args.ranks * 1.3 * (1 << 30)) + (64 << 20)
    with open(tmp / "ckptd.log", "ab") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", str(tmp / "ckptd.sock"),
             "--root", str(root), "--pool-size", str(pool), "--writers", "2"],
            stdout=log, stderr=log)
    try:
        problem = wait_until_ready(str(tmp / "ckptd.sock"), daemon, 120.0)
        if problem:
            raise SystemExit(f"ckptd {problem}; see {tmp / 'ckptd.log'}")
        results = values(run_ranks(one_rank, args.ranks, str(tmp / "ckptd.sock"), tmp,
                                   args=(str(root), args.size_gib, args.saves, args.before),
                                   timeout=900))
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.ranks} gloo ranks, {args.size_gib} GiB training state a rank "
          f"({results[0]['tensors']} tensors), {args.saves} saves of each kind, alternated\n")
    print("| rank | planning | call ms, median (min–max) | memcpy bound ms, same slots "
          "(min–max) | call / bound (ratio of medians) |\n|---|---|---|---|---|")
    for rank, result in enumerate(results):
        runs = result["runs"]
        bound = statistics.median(runs["bound"])
        for label, name in (("after", "current"), ("before", BEFORE[args.before][1])):
            print(f"| {rank} | {name} | {spread(runs[label])} | {spread(runs['bound'])} | "
                  f"{statistics.median(runs[label]) / bound:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
