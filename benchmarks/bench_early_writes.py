"""Writes that start while the trainer copies: what the blocking call and durability gain
or lose, with the copy reports on and off alternated save by save.

A trainer copying a large save reports how far it got every ``CKPTD_COPY_REPORT_BYTES``,
and the writers write what is copied while it copies the rest (by default only a
zero-stall save's background copy on a node with 4 CPUs or more: ``CKPTD_COPY_REPORTS``). The writes take memory
bandwidth and CPU from the copy beside them, so both sides are measured here, zero-stall
and blocking, on one daemon and one state dict, the variants taking turns save by save
(the machine's speed drifts between minutes):

- the save call against the memcpy bound (the state copied into preallocated tensors
  right before the call), ratio of medians, with the bound's median and spread;
- the call to durable (the call, then ``finalize``) against a raw O_DIRECT write + fsync
  of the same bytes from anonymous memory, measured right before the call.

Run under ``/work/bin/texcl`` (it holds the machine)::

    python benchmarks/bench_early_writes.py --size-gib 1 --saves 6
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
import methods as m  # noqa: E402
import workload  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--saves", type=int, default=6, help="timed saves per variant")
    parser.add_argument("--warmups", type=int, default=2, help="untimed saves per variant")
    parser.add_argument("--workdir", default="/var/tmp", help="parent of the checkpoints")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ckptd-bench-early-", dir=args.workdir)
    daemon = Daemon(root, int(args.size_gib * 2.5 * 2**30), 2)
    os.environ["CKPTD_SOCKET"] = daemon.socket
    try:
        import ckpt_client
        from ckpt_client import TorchAsyncCheckpoint, dcp
        from ckptd import knobs

        state, _ = workload.build("training", int(args.size_gib * 2**30))
        tensors = workload.tensors_of(state)
        copies = [torch.empty_like(t) for t in tensors]
        staging = m.PreallocatedCopy(tensors, one_call=True)
        staging.prepare()
        staging.start("")
        raw = m.RawWrite(staging, direct=True)
        raw.prepare()
        checkpoint, queue = TorchAsyncCheckpoint(), ckpt_client.AsyncCallsQueue()

        def torch_save(path: str, zero_stall: bool):
            checkpoint.async_save(state, path + ".pt", zero_stall=zero_stall)
            return lambda: checkpoint.finalize_async_save(blocking=True)

        def dcp_save(path: str, zero_stall: bool):
            queue.schedule_async_request(dcp.async_save(state, path, enable_cache=True,
                                                        zero_stall=zero_stall))
            return lambda: queue.maybe_finalize_async_calls(blocking=True, no_dist=True)

        step = knobs.COPY_REPORT_BYTES.get() >> 20
        variants = {}  # name -> (save, zero_stall, CKPTD_COPY_REPORTS)
        for fmt, save in (("torch format", torch_save), ("cached DCP", dcp_save)):
            variants[f"{fmt}, zero-stall, reports every {step} MiB (CKPTD_COPY_REPORTS="
                     "background, the default on 4+ CPUs)"] = (save, True, "background")
            variants[f"{fmt}, zero-stall, no reports"] = (save, True, "off")
            variants[f"{fmt}, blocking, reports every {step} MiB (CKPTD_COPY_REPORTS=always)"] = \
                (save, False, "always")
            variants[f"{fmt}, blocking, no reports (the default)"] = (save, False, "background")
        rows = {name: {"call": [], "bound": [], "durable": [], "raw": []} for name in variants}
        for round_ in range(args.warmups + args.saves):
            for name, (save, zero_stall, reports) in variants.items():
                path = os.path.join(root, "ckpt")
                started = time.perf_counter()
                raw.start(path + "-raw")
                raw_s = time.perf_counter() - started
                m.remove_tree(path + "-raw")
                started = time.perf_counter()
                torch._foreach_copy_(copies, tensors)
                bound = time.perf_counter() - started
                with knobs.override(COPY_REPORTS=reports):
                    started = time.perf_counter()
                    finish = save(path, zero_stall)
                    call = time.perf_counter() - started
                    finish()
                    durable = time.perf_counter() - started
                for leftover in (path, path + ".pt"):
                    m.remove_tree(leftover)
                if round_ >= args.warmups:
                    for key, value in (("call", call), ("bound", bound), ("durable", durable),
                                       ("raw", raw_s)):
                        rows[name][key].append(value)
        checkpoint.close()
        queue.close()
        raw.close()
        staging.close()
        print(f"{len(tensors)} tensors, {args.size_gib} GiB, {args.saves} saves a variant "
              f"after {args.warmups} warm-ups, alternated; load {os.getloadavg()[0]:.2f}")
        print("| variant | call s (min-max) | memcpy bound s, same slots (min-max) | call / bound "
              "| call to durable s (min-max) | raw O_DIRECT write + fsync s, same slots (min-max) "
              "| durable / raw |")
        print("|---|---|---|---|---|---|---|")
        med = statistics.median
        for name, row in rows.items():
            spread = {k: f"{med(v):.4f} ({min(v):.4f}-{max(v):.4f})" for k, v in row.items()}
            print(f"| {name} | {spread['call']} | {spread['bound']} | "
                  f"**{med(row['call']) / med(row['bound']):.2f}x** | {spread['durable']} | "
                  f"{spread['raw']} | **{med(row['durable']) / med(row['raw']):.2f}x** |")
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
