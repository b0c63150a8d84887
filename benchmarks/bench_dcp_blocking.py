"""The default DCP save's blocking call, variants alternated save by save.

``bench_save.py`` times each method's runs one after another, so a method meets the
machine of its own minutes (on a shared 2-core machine the memcpy bound moves by ±25 %
between neighbouring rows). To compare variants of ``ckpt_client.dcp.async_save``, this
benchmark alternates them save by save on one daemon and one state dict, measures the
memcpy bound (the state copied into preallocated buffers) right before every call, and
reports per variant the ratio of medians: median(call) / median(bound in the same
slots), with the bound's own median and spread. A zero-stall variant is held against
its target instead, 5 ms + 5 µs a tensor.

Variants: the blocking save without a cache (its guessed copy) and with
``enable_cache``, each as today and with the guessed copy's STAGE sent after its items
are looked up (``CKPTD_DCP_STAGE_AHEAD=0``), an uncached zero-stall call, optionally
session 9's comparison (``--with-before``: before the kept descriptions and the cached
save's guessed copy, ``CKPTD_DCP_KEEP_DESCRIPTIONS=0``, ``CKPTD_DCP_GUESS_CACHED=0``) and
the copy after planning (``CKPTD_DCP_GUESS_PLAN=0``, ``--with-unguessed``).

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

_NOW = {"DCP_KEEP_DESCRIPTIONS": True, "DCP_GUESS_CACHED": True, "DCP_STAGE_AHEAD": True}
_BEFORE = {"DCP_KEEP_DESCRIPTIONS": False, "DCP_GUESS_CACHED": False, "DCP_STAGE_AHEAD": False}
_STAGE_AFTER = {**_NOW, "DCP_STAGE_AHEAD": False}
#: name -> (knob settings, enable_cache, zero_stall), in the order they alternate. Each
#: is staged right after a save whose descriptions it would (or, before, would not) share
#: in a training loop of its own: the trainer's pool views and layout are kept for the
#: last description list only, and a save after another kind's would miss them. A
#: zero-stall call returns before its copy, so it may follow any.
VARIANTS = {"zero_stall, no cache": (_NOW, False, True),
            "default (guessed copy)": (_NOW, False, False),
            "enable_cache": (_NOW, True, False),
            "default, STAGE after the lookups (CKPTD_DCP_STAGE_AHEAD=0)":
                (_STAGE_AFTER, False, False),
            "enable_cache, STAGE after the lookups": (_STAGE_AFTER, True, False)}
#: Session 9's comparison (``--with-before``): before the kept descriptions and the cached
#: save's guessed copy.
BEFORE = {"default, before (no kept descriptions)": (_BEFORE, False, False),
          "zero_stall, no cache, before": (_BEFORE, False, True),
          "enable_cache, before (no guess, no kept descriptions)": (_BEFORE, True, False)}
UNGUESSED = ("copy after planning (CKPTD_DCP_GUESS_PLAN=0)",
             ({**_NOW, "DCP_GUESS_PLAN": False}, False, False))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=8, help="timed saves per variant")
    parser.add_argument("--warmups", type=int, default=3, help="untimed saves per variant")
    parser.add_argument("--with-before", action="store_true",
                        help="also the variants before the kept descriptions")
    parser.add_argument("--with-unguessed", action="store_true",
                        help="also the copy after planning (CKPTD_DCP_GUESS_PLAN=0)")
    args = parser.parse_args(argv)
    variants = dict(VARIANTS)
    if args.with_before:
        variants.update(BEFORE)
    if args.with_unguessed:
        variants[UNGUESSED[0]] = UNGUESSED[1]
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
        calls = {name: [] for name in variants}
        bounds = {name: [] for name in variants}
        for round_ in range(args.warmups + args.saves):
            for name, (settings, cache, zero_stall) in variants.items():
                path = os.path.join(root, "ckpt")
                started = time.perf_counter()
                torch._foreach_copy_(copies, tensors)
                bound = time.perf_counter() - started
                with knobs.override(**settings):
                    started = time.perf_counter()
                    request = dcp.async_save(state, path, enable_cache=cache,
                                             zero_stall=zero_stall)
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
        target = 0.005 + 5e-6 * len(tensors)
        print(f"| variant | call s, median (min-max) | bound s, same slots (min-max) "
              f"| call / bound | call - bound, ms (median of the saves') "
              f"| call / zero-stall target ({target * 1e3:.1f} ms) |")
        print("|---|---|---|---|---|---|")
        for name, (_, _, zero_stall) in variants.items():
            c, b = calls[name], bounds[name]
            ratio = statistics.median(c) / statistics.median(b)
            over = statistics.median(x - y for x, y in zip(c, b)) * 1e3
            print(f"| {name} | {statistics.median(c):.4f} ({min(c):.4f}-{max(c):.4f}) | "
                  f"{statistics.median(b):.4f} ({min(b):.4f}-{max(b):.4f}) | "
                  + (f"{ratio:.3f}x | - | **{statistics.median(c) / target:.2f}x** |"
                     if zero_stall else f"**{ratio:.3f}x** | {over:.1f} | - |"))
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
