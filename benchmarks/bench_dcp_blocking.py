"""The default DCP save's blocking call, variants alternated save by save.

``bench_save.py`` times each method's runs one after another, so a method meets the
machine of its own minutes (on a shared 2-core machine the memcpy bound moves by ±25 %
between neighbouring rows). To compare two variants of ``ckpt_client.dcp.async_save``,
this benchmark alternates them save by save on one daemon and one state dict, measures
the memcpy bound (the state copied into preallocated buffers) right before every call,
and reports per variant the ratio of medians: median(call) / median(bound in the same
slots), with the bound's own median and spread. Variants are the blocking save with its
guessed copy (the default), with ``CKPTD_DCP_GUESS_PLAN=0`` (copy after planning, as
before), and with ``enable_cache=True``.

Run under ``/work/bin/texcl`` (it holds the machine)::

    python benchmarks/bench_dcp_blocking.py --size-gib 1 --saves 8
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save import Daemon  # noqa: E402
import workload  # noqa: E402

#: name -> (CKPTD_DCP_GUESS_PLAN, enable_cache)
VARIANTS = {"default (guessed copy)": (True, False),
            "copy after planning (CKPTD_DCP_GUESS_PLAN=0)": (False, False),
            "enable_cache": (True, True)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=8, help="timed saves per variant")
    parser.add_argument("--warmups", type=int, default=3, help="untimed saves per variant")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ckptd-bench-dcp-", dir="/var/tmp")
    daemon = Daemon(root, int(args.size_gib * 2.5 * 2**30), 2)
    try:
        import ckpt_client
        from ckpt_client import dcp
        from ckptd import knobs

        state, _ = workload.build("training", int(args.size_gib * 2**30))
        tensors = workload.tensors_of(state)
        copies = [torch.empty_like(t) for t in tensors]
        torch._foreach_copy_(copies, tensors)
        queue = ckpt_client.AsyncCallsQueue()
        calls = {name: [] for name in VARIANTS}
        bounds = {name: [] for name in VARIANTS}
        for round_ in range(args.warmups + args.saves):
            for name, (guess, cache) in VARIANTS.items():
                path = os.path.join(root, "ckpt")
                started = time.perf_counter()
                torch._foreach_copy_(copies, tensors)
                bound = time.perf_counter() - started
                with knobs.override(DCP_GUESS_PLAN=guess):
                    started = time.perf_counter()
                    request = dcp.async_save(state, path, enable_cache=cache)
                    call = time.perf_counter() - started
                queue.schedule_async_request(request)
                queue.maybe_finalize_async_calls(blocking=True)
                shutil.rmtree(path, ignore_errors=True)
                if round_ >= args.warmups:
                    calls[name].append(call)
                    bounds[name].append(bound)
        queue.close()
        print(f"{len(tensors)} tensors, {args.size_gib} GiB, {args.saves} saves a variant, "
              f"alternated; load {os.getloadavg()[0]:.2f}")
        print("| variant | call s, median (min-max) | bound s, same slots (min-max) "
              "| call / bound |")
        print("|---|---|---|---|")
        for name in VARIANTS:
            c, b = calls[name], bounds[name]
            print(f"| {name} | {statistics.median(c):.4f} ({min(c):.4f}-{max(c):.4f}) | "
                  f"{statistics.median(b):.4f} ({min(b):.4f}-{max(b):.4f}) | "
                  f"**{statistics.median(c) / statistics.median(b):.2f}x** |")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
