"""Fifty saves of a CUDA training state through one daemon: does GPU memory stay flat?

A trainer that checkpoints every few hundred steps for days must not lose GPU memory to
its checkpoints: every export the daemon drops must be paid back (torch keeps a freed
block out of reuse until each process that opened it lets go), and the daemon's own
device memory must not grow with the number of saves. For each mode (the default save and
``zero_stall=True``) this saves the realistic ``training`` workload (``workload.py``) on
the GPU through ``ckpt_client.TorchAsyncCheckpoint`` 5 times to warm up, then 50 times,
each time with a new temporary tensor in the state (a block that must not stay pinned)
and an in-place update of every tensor between saves (the optimizer step), and reports:

- this process's ``memory_allocated`` / ``memory_reserved`` and the device's used memory
  (all processes: the daemon's context and mappings too) before and after the 50 saves;
- the ``torch_*`` files in /dev/shm (the IPC reference-counter files);
- the save call's median time against the pinned device-to-host bound (one non-blocking
  copy per tensor into a preallocated page-locked buffer, then a synchronise), measured
  in the same loop right before each save: the ratio of medians and the bound's spread;
  zero-stall calls also against the target 5 ms + 5 µs a tensor.

Usage::

    python benchmarks/bench_gpu_saves.py --size-gib 1 --out benchmarks/RESULTS_GPU_saves.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_save import GiB, Daemon, machine_facts, on_device, spread  # noqa: E402
import methods as m  # noqa: E402
from report import publish  # noqa: E402
import workload  # noqa: E402

MiB = 1 << 20


def shm_counter_files() -> int:
    """torch's IPC reference-counter files in /dev/shm."""
    return sum(1 for name in os.listdir("/dev/shm") if name.startswith("torch_"))


def memory() -> dict:
    """This process's allocator figures and the device's used bytes (every process)."""
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    free, total = torch.cuda.mem_get_info()
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
            "device_used": total - free, "shm_files": shm_counter_files()}


def run_mode(state: dict, tensors: list, outdir: str, zero_stall: bool, saves: int) -> dict:
    """Warm up, then ``saves`` saves; memory before and after, call times and bound."""
    import ckpt_client

    checkpoint = ckpt_client.TorchAsyncCheckpoint()
    copy = m.PreallocatedCopy(tensors)
    copy.prepare()
    path = os.path.join(outdir, "zero_stall.pt" if zero_stall else "default.pt")
    calls, bounds = [], []
    updated = [t for t in tensors if t.is_floating_point()]
    try:
        def one(record: bool) -> None:
            t0 = time.perf_counter()
            copy.start("")
            bound = time.perf_counter() - t0
            temporary = tensors[0] * 2  # saved once, then freed: must not stay pinned
            t0 = time.perf_counter()
            checkpoint.async_save({"state": state, "temporary": temporary}, path,
                                  zero_stall=zero_stall)
            call = time.perf_counter() - t0
            checkpoint.finalize_async_save(blocking=True)
            del temporary
            torch._foreach_add_(updated, 1)  # the optimizer step between saves
            if record:
                calls.append(call)
                bounds.append(bound)

        for _ in range(5):
            one(False)
        before = memory()
        for _ in range(saves):
            one(True)
        after = memory()
    finally:
        checkpoint.close()
        copy.close()
    row = {"mode": "zero_stall" if zero_stall else "default", "saves": saves,
           "before": before, "after": after, "call_runs": calls, "bound_runs": bounds,
           "call_s": statistics.median(calls), "bound_s": statistics.median(bounds)}
    row["ratio"] = row["call_s"] / row["bound_s"]
    print(f"  {row['mode']}: call {row['call_s'] * 1e3:.1f} ms = {row['ratio']:.2f}x the bound; "
          f"allocated {before['allocated'] / MiB:.0f} -> {after['allocated'] / MiB:.0f} MiB, "
          f"device used {before['device_used'] / MiB:.0f} -> {after['device_used'] / MiB:.0f} MiB",
          flush=True)
    return row


def profile_calls(state: dict, outdir: str, saves: int = 5) -> None:
    """Where the trainer's time in a default save call goes: cProfile of ``saves`` calls
    after two unprofiled ones (a storage's first two saves export it afresh; later ones
    re-send the export the daemon holds), each finalized outside the profile; the top
    functions by own and by cumulative time."""
    import cProfile
    import pstats

    import ckpt_client

    checkpoint = ckpt_client.TorchAsyncCheckpoint()
    profile = cProfile.Profile()
    try:
        for n in range(saves + 2):
            if n >= 2:
                profile.enable()
            checkpoint.async_save(state, os.path.join(outdir, "profiled.pt"))
            profile.disable()
            checkpoint.finalize_async_save(blocking=True)
    finally:
        checkpoint.close()
    print(f"\ncProfile of {saves} default save calls (own time, then cumulative):", flush=True)
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)


def render(report: dict) -> str:
    facts = report["facts"]
    lines = ["# ckptd: GPU memory over many saves", "",
             f"Measured {report['date']} by `{report['command']}` ({report['wall_s']:.0f} s).", "",
             f"- Machine: {facts['cpu']}, {facts['cores']} cores, torch {facts['torch']}; "
             f"GPU: {facts.get('gpu')}.",
             f"- State: the `training` workload on the GPU, {report['bytes'] / GiB:.3f} GiB in "
             f"{report['tensors']} tensors, plus a fresh temporary each save; an in-place update "
             "of every tensor between saves.", "",
             "| mode | saves | allocated MiB before → after | reserved MiB before → after "
             "| device used MiB (all processes) before → after | torch_* shm files "
             "| call ms, median (min–max) | pinned D2H bound ms, median (min–max) "
             "| call / bound (ratio of medians) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        b, a = r["before"], r["after"]
        ms = [x * 1e3 for x in r["call_runs"]]
        bound_ms = [x * 1e3 for x in r["bound_runs"]]
        lines.append(
            f"| {r['mode']} | {r['saves']} | {b['allocated'] / MiB:.0f} → {a['allocated'] / MiB:.0f} "
            f"| {b['reserved'] / MiB:.0f} → {a['reserved'] / MiB:.0f} "
            f"| {b['device_used'] / MiB:.0f} → {a['device_used'] / MiB:.0f} "
            f"| {b['shm_files']} → {a['shm_files']} | {spread(ms)} | {spread(bound_ms)} "
            f"| **{r['ratio']:.2f}×** |")
    target = 0.005 + 5e-6 * report["tensors"]
    zero = [r for r in report["rows"] if r["mode"] == "zero_stall"]
    if zero:
        lines += ["", f"Zero-stall call against its target 5 ms + 5 µs a tensor "
                  f"({target * 1e3:.1f} ms): **{zero[0]['call_s'] / target:.2f}×**."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--saves", type=int, default=50)
    p.add_argument("--writers", type=int, default=2)
    p.add_argument("--workdir", default=None, help="parent of the checkpoint directory")
    p.add_argument("--out", default=None, help="write the Markdown report (and .json) here")
    p.add_argument("--profile", action="store_true",
                   help="also print a cProfile of a few default save calls")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: this benchmark measures GPU memory and runs only on a GPU "
              "machine.", file=sys.stderr)
        return 2
    started = time.time()
    outdir = tempfile.mkdtemp(prefix="ckpt-bench-gpu-", dir=args.workdir)
    total = int(args.size_gib * GiB)
    state, mix = workload.build("training", total, device="cpu")
    state = on_device(state, "cuda")
    tensors = workload.tensors_of(state)
    daemon = Daemon(outdir, -(-int(1.1 * mix.total_bytes) // MiB) * MiB, args.writers)
    report = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
              "facts": machine_facts(args.workdir or tempfile.gettempdir()),
              "bytes": mix.total_bytes, "tensors": len(tensors), "rows": []}
    try:
        if args.profile:  # first: a run cut short by its time cap still has it
            profile_calls(state, outdir)
        for zero in (False, True):
            report["rows"].append(run_mode(state, tensors, outdir, zero, args.saves))
            report["wall_s"] = time.time() - started
            publish(args.out, render(report), report)  # each mode's row as soon as it is in
    finally:
        daemon.stop()
        m.remove_tree(outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
