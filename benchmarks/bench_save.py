"""Checkpoint save benchmark: ckptd against the lower bounds and the PyTorch ways of saving.

In one run, on one state dict (>= 1 GiB by default; a realistic mix of large, medium and
small tensors in fp32/bf16/fp16/int64 plus a few plain values, see ``workload.py``), it
measures side by side:

- memcpy into a preallocated, pre-faulted shared-memory buffer (lower bound for staging)
  and a fresh ``clone()`` (for contrast);
- a raw sequential write + fsync of the same bytes (the disk limit; buffered, 32 MiB
  writes), and the same with ``O_DIRECT``;
- ``torch.save`` + fsync; stock DCP ``save`` (``FileSystemWriter``);
- stock DCP ``async_save`` with the process executor, with the default stager and with a
  reused shared-memory stager;
- ckptd: ``TorchAsyncCheckpoint.async_save`` and ``ckpt_client.dcp.async_save`` on an
  ``AsyncCallsQueue``, against a real ``ckptd serve`` subprocess started here.

For each method: the blocking time (until the call returns and training may go on),
the time to durable (until the files are fsynced and committed), throughput, peak
memory (the trainer's ``VmHWM``, its helper processes' ``VmHWM``, and the job's unique
resident memory sampled from outside), and the duration of the first "training step"
run right after the save returns, against the same step with no save in flight. Each
measurement runs ``--repeats`` times after one warm-up (medians reported); durations are
measured in separate runs with and without the step, so the step does not inflate the
time to durable and vice versa. The page cache is dropped before every timed run when
the kernel lets us (``/proc/sys/vm/drop_caches``).

If CUDA is available the suite runs again with the state dict on the GPU: the lower
bound becomes a pinned device-to-host copy, and ckptd receives CUDA tensors.

Usage::

    python benchmarks/bench_save.py --size-gib 1.0 --repeats 3 --out benchmarks/RESULTS.md
    python benchmarks/bench_save.py --quick          # 64 MiB smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import methods as m  # noqa: E402
from ckptd.protocol import wait_until_ready  # noqa: E402
from report import publish, stop_daemon, write_report  # noqa: E402
import procmem  # noqa: E402
from procmem import loadavg  # noqa: E402
import workload  # noqa: E402

GiB = 1 << 30
GB = 1e9


# ---------------------------------------------------------------- environment

def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False where not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def mount_of(path: str) -> tuple[str, str, str]:
    """(device, mount point, fs type) holding ``path``."""
    path = os.path.realpath(path)
    best = ("?", "/", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    return best


def machine_facts(workdir: str) -> dict:
    """Cores, memory, disk and load, for the report."""
    with open("/proc/meminfo") as f:
        mem_total = int(next(l for l in f if l.startswith("MemTotal")).split()[1]) * 1024
    dev, mnt, fstype = mount_of(workdir)
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    rotational = "?"
    block = os.path.basename(dev)
    if os.path.exists(f"/sys/block/{block}/queue/rotational"):
        with open(f"/sys/block/{block}/queue/rotational") as f:
            rotational = ("kernel says rotational" if f.read().strip() == "1"
                          else "kernel says non-rotational")
    return {"cpu": cpu, "cores": os.cpu_count(), "code": code_version(), "torch_threads": torch.get_num_threads(),
            "mem_total_gib": round(mem_total / GiB, 1), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__,
            "workdir": workdir, "disk": f"{dev} ({rotational}) mounted on {mnt}, {fstype}",
            "fstype": fstype, "gpu": gpu_facts()}


def gpu_facts() -> str | None:
    """The devices, driver and CUDA of a GPU machine (``None`` without CUDA)."""
    if not torch.cuda.is_available():
        return None
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    driver = "?"
    try:
        with open("/proc/driver/nvidia/version") as f:
            # "... Kernel Module  580.159.04 ..." or "... Open Kernel Module for x86_64
            # 580.159.04 ...": the first dotted version number on the line
            driver = re.search(r"Kernel Module.*?\b(\d+\.\d+(?:\.\d+)?)\b", f.read()).group(1)
    except (OSError, AttributeError):
        pass
    return f"{len(names)}× {names[0]}, driver {driver}, CUDA {torch.version.cuda} (torch's)"


def code_version() -> str:
    """The commit measured, and whether ckptd/ckpt_client had uncommitted changes."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "ckptd", "ckpt_client"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}" + (" + uncommitted changes in ckptd/ckpt_client" if dirty else "")


# ---------------------------------------------------------------- the daemon

class Daemon:
    """A real ``python -m ckptd serve`` subprocess for the benchmark."""

    def __init__(self, root: str, pool_size: int, writers: int) -> None:
        self.rundir = tempfile.mkdtemp(prefix="ckptd-bench-")  # mode 0700
        self.socket = os.path.join(self.rundir, "ckptd.sock")
        self.log_path = os.path.join(self.rundir, "ckptd.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", self.socket, "--root", root,
             "--pool-size", str(pool_size), "--writers", str(writers)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log)
        problem = wait_until_ready(self.socket, self.proc, 120.0)
        if problem:
            raise RuntimeError(f"ckptd {problem}; see {self.log_path}")
        self.pid = self.proc.pid
        os.environ["CKPTD_SOCKET"] = self.socket

    def log_offset(self) -> int:
        return os.path.getsize(self.log_path)

    def log_since(self, offset: int) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def stop(self) -> None:
        stop_daemon(self.proc)
        self._log.close()
        os.environ.pop("CKPTD_SOCKET", None)
        shutil.rmtree(self.rundir, ignore_errors=True)


_DURABLE_RE = re.compile(r"durable: (\d+) bytes in ([0-9.]+)s after staging")
STAGED_RE = re.compile(r"staged in ([0-9.]+)s; writing (\d+) file")


# ---------------------------------------------------------------- measuring

@dataclass
class Sample:
    """One timed save."""

    blocking_s: float
    durable_s: float
    step_s: float | None = None
    guard_s: float = 0.0
    daemon_peak: int = 0
    trainer_peak: int = 0
    trainer_before: int = 0
    helpers_peak: int = 0
    unique_peak: int = 0
    unique_before: int = 0
    bytes_on_disk: int = 0
    daemon_write_s: float | None = None
    daemon_stage_s: float | None = None
    ref_copy_s: float | None = None
    ref_raw_s: float | None = None
    ref_step_s: float | None = None


@dataclass
class Result:
    """Medians over the repeats of one method."""

    name: str
    kind: str
    blocking_s: float
    durable_s: float | None
    step_after_s: float | None
    durable_with_step_s: float | None
    trainer_peak_gib: float
    trainer_extra_gib: float
    helpers_peak_gib: float
    unique_peak_gib: float
    unique_extra_gib: float
    bytes_on_disk: int
    daemon_write_s: float | None = None
    daemon_stage_s: float | None = None
    blocking_ratio: float | None = None   # ratio of medians: blocking / memcpy bound
    bound_s: float | None = None          # median of the bound measured in the same slots
    durable_ratio: float | None = None    # ratio of medians: durable / raw disk
    step_ratio: float | None = None       # ratio of medians: step after save / step before
    load: str = ""
    guard_s: float | None = None
    wait_total_s: float | None = None
    wait_ratio: float | None = None       # ratio of medians: (call + guard) / memcpy bound
    daemon_peak_gib: float | None = None
    wait_runs: list = field(default_factory=list)
    ref_copy_runs: list = field(default_factory=list)
    ref_raw_runs: list = field(default_factory=list)
    blocking_runs: list = field(default_factory=list)
    durable_runs: list = field(default_factory=list)
    step_runs: list = field(default_factory=list)


class Bench:
    """Runs methods on one state dict and collects :class:`Result` rows."""

    def __init__(self, state: dict, total_bytes: int, outdir: str, repeats: int,
                 device: str, watch: procmem.MemWatch, daemon: Daemon | None = None) -> None:
        self.state = state
        self.total_bytes = total_bytes
        self.outdir = outdir
        self.repeats = repeats
        self.device = device
        self.watch = watch
        self.daemon = daemon
        self.step = workload.TrainingStep(state, device)
        self.caches_dropped = True
        self.baseline_steps: list[float] = []
        self.ref_copy: m.PreallocatedCopy | None = None
        self.ref_raw: m.RawWrite | None = None

    def _raw_reference(self, method: m.Method, path: str) -> float | None:
        """A raw-disk write + fsync of the same bytes, measured right before a run.

        The machine is shared: measuring the bounds beside each run keeps the ratios
        honest when the load changes during the benchmark.
        """
        raw_s = None
        if method.kind != "bound" and method.writes and self.ref_raw is not None:
            ref_path = path + "-rawref"
            m.remove_tree(ref_path)
            self.caches_dropped &= drop_caches()
            start = time.perf_counter()
            self.ref_raw.start(ref_path)
            raw_s = time.perf_counter() - start
            m.remove_tree(ref_path)
        return raw_s

    def _copy_reference(self, method: m.Method) -> float | None:
        """The memcpy bound, measured in the same slot as the run it is compared with:
        after the same clean-up, cache drop and collection, right before the save call.

        An untimed copy goes first: the cache drop leaves the kernel freeing pages for a
        while, and whatever runs first after it pays for that. The timed bound and the
        save call then both follow a copy of the same bytes.
        """
        if method.kind == "bound" or self.ref_copy is None:
            return None
        self.ref_copy.start("")
        start = time.perf_counter()
        self.ref_copy.start("")
        return time.perf_counter() - start

    def measure_baseline_step(self, runs: int = 5) -> float:
        """Median duration of the training step with nothing in flight."""
        self.step.run()
        times = [self.step.run() for _ in range(runs)]
        self.baseline_steps += times
        return statistics.median(times)

    def _one(self, method: m.Method, path: str, with_step: bool, refs: bool = False) -> Sample:
        ref_raw_s = self._raw_reference(method, path) if refs and not with_step else None
        # The same step with nothing in flight, right before: its pair for the ratio.
        ref_step_s = self.step.run() if with_step else None
        m.remove_tree(path)
        self.caches_dropped &= drop_caches()
        gc.collect()
        if isinstance(method, m.PreallocatedCopy):  # the untimed copy before every bound
            method.start("")
        helpers = method.helper_pids()
        for pid in [os.getpid(), *helpers]:
            procmem.reset_peak(pid)
        trainer_before = procmem.read_status(os.getpid()).get("VmRSS", 0)
        before = self.watch.reset()["current"]
        log_at = self.daemon.log_offset() if self.daemon and method.name.startswith("ckptd") else None
        guard: list[float] = []
        ref_copy_s = self._copy_reference(method) if refs else None

        def before_update() -> None:  # where guard_optimizer's pre-hook waits
            g0 = time.perf_counter()
            method.before_update()
            guard.append(time.perf_counter() - g0)

        t0 = time.perf_counter()
        method.start(path)
        t1 = time.perf_counter()
        step_s = self.step.run(before_update) if with_step else None
        method.wait_durable()
        t2 = time.perf_counter()
        mem = self.watch.read()
        sample = Sample(
            blocking_s=t1 - t0, durable_s=t2 - t0, step_s=step_s, guard_s=sum(guard),
            daemon_peak=mem.get("sub_peak", 0),
            trainer_peak=procmem.read_status(os.getpid()).get("VmHWM", 0),
            trainer_before=trainer_before,
            helpers_peak=procmem.peak_of(method.helper_pids()),
            unique_peak=mem["peak"], unique_before=before,
            bytes_on_disk=m.bytes_under(path, lambda n: not n.endswith(".ckptd-sum")),
            ref_copy_s=ref_copy_s, ref_raw_s=ref_raw_s, ref_step_s=ref_step_s)
        if log_at is not None:
            log = self.daemon.log_since(log_at)
            times = [float(x) for _, x in _DURABLE_RE.findall(log)]
            sample.daemon_write_s = max(times) if times else None
            staged = [float(x) for x, _ in STAGED_RE.findall(log)]
            sample.daemon_stage_s = sum(staged) if staged else None
        return sample

    def run(self, method: m.Method) -> Result:
        """Warm up once, then ``repeats`` runs without and ``repeats`` runs with the step."""
        print(f"  {method.name} ...", flush=True)
        load = loadavg()
        base = os.path.join(self.outdir, re.sub(r"[^A-Za-z0-9]+", "_", method.name))
        try:
            method.prepare()
            self._one(method, os.path.join(base, "warmup"), with_step=False)
            idle = [self._one(method, os.path.join(base, f"run{i}"), False, refs=True)
                    for i in range(self.repeats)]
            stepped = [self._one(method, os.path.join(base, f"step{i}"), True, refs=True)
                       for i in range(self.repeats)]
        finally:
            method.close()
            m.remove_tree(base)
        result = summarize(method, idle, stepped)
        result.load = load
        print(f"    call {result.blocking_s:.3f}s  waits {fmt(result.wait_total_s)}s "
              f"({fmt(result.wait_ratio, 2)}x memcpy)  durable {fmt(result.durable_s)}s  "
              f"step after {fmt(result.step_after_s)}s  unique peak "
              f"{result.unique_peak_gib:.2f} GiB", flush=True)
        return result


def med(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(method: m.Method, idle: list[Sample], stepped: list[Sample]) -> Result:
    both = idle + stepped
    durable = med([s.durable_s for s in idle]) if method.writes else None
    return Result(
        name=method.name, kind=method.kind,
        blocking_s=med([s.blocking_s for s in idle]),
        durable_s=durable,
        step_after_s=med([s.step_s for s in stepped]),
        durable_with_step_s=med([s.durable_s for s in stepped]) if method.kind == "async" else None,
        trainer_peak_gib=max(s.trainer_peak for s in both) / GiB,
        trainer_extra_gib=max(s.trainer_peak - s.trainer_before for s in both) / GiB,
        helpers_peak_gib=max(s.helpers_peak for s in both) / GiB,
        unique_peak_gib=max(s.unique_peak for s in both) / GiB,
        unique_extra_gib=max(s.unique_peak - s.unique_before for s in both) / GiB,
        bytes_on_disk=int(med([s.bytes_on_disk for s in idle]) or 0),
        daemon_write_s=med([s.daemon_write_s for s in idle]),
        daemon_stage_s=med([s.daemon_stage_s for s in idle]),
        blocking_ratio=ratio_of_medians([s.blocking_s for s in idle], [s.ref_copy_s for s in idle]),
        bound_s=med([s.ref_copy_s for s in idle]),
        durable_ratio=(ratio_of_medians([s.durable_s for s in idle], [s.ref_raw_s for s in idle])
                       if method.writes else None),
        step_ratio=ratio_of_medians([s.step_s for s in stepped], [s.ref_step_s for s in stepped]),
        guard_s=med([s.guard_s for s in stepped]),
        wait_total_s=med([s.blocking_s + s.guard_s for s in stepped]),
        wait_ratio=ratio_of_medians([s.blocking_s + s.guard_s for s in stepped],
                                    [s.ref_copy_s for s in stepped]),
        daemon_peak_gib=(max(s.daemon_peak for s in both) / GiB
                         if method.name.startswith("ckptd") else None),
        wait_runs=[round(s.blocking_s + s.guard_s, 4) for s in stepped],
        blocking_runs=[round(s.blocking_s, 4) for s in idle],
        durable_runs=[round(s.durable_s, 4) for s in idle],
        step_runs=[round(s.step_s, 4) for s in stepped if s.step_s is not None],
        ref_copy_runs=[round(s.ref_copy_s, 4) for s in idle if s.ref_copy_s],
        ref_raw_runs=[round(s.ref_raw_s, 4) for s in idle if s.ref_raw_s])


def ratio_of_medians(values: list, bounds: list) -> float | None:
    """median(values) / median(bounds), each over the runs that have both."""
    pairs = [(v, b) for v, b in zip(values, bounds) if v is not None and b]
    if not pairs:
        return None
    return statistics.median(v for v, _ in pairs) / statistics.median(b for _, b in pairs)


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


# ---------------------------------------------------------------- suites

def init_single_process_group(rundir: str) -> None:
    """A world-size-1 gloo group: DCP's process executor requires torch.distributed."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{rundir}/pg-store", rank=0,
                                world_size=1)


def chosen_by(key: str, name: str) -> bool:
    """Whether ``--only``'s ``key`` picks the method ``name``: a part of the name, or with
    a leading ``=`` the whole name (case-insensitive)."""
    name = name.lower()
    return name == key[1:] if key.startswith("=") else key in name


def side_by_side(state: dict, copy: m.PreallocatedCopy) -> list[m.Method]:
    """The methods of the side-by-side comparison (issue 11): every workload, every device."""
    return [copy, m.DcpAsyncSave(state, "shared"), m.DcpAsyncSave(state, "async"),
            m.CkptdTorch(state), m.CkptdDcp(state), m.CkptdDcp(state, own_planning=True),
            m.CkptdDcp(state, copy_after_plan=True), m.CkptdDcp(state, enable_cache=True),
            m.CkptdTorch(state, zero_stall=True), m.CkptdDcp(state, zero_stall=True),
            m.CkptdDcp(state, zero_stall=True, own_planning=True),
            m.CkptdDcp(state, enable_cache=True, zero_stall=True)]


def full_methods(state: dict, tensors: list, copy: m.PreallocatedCopy) -> list[m.Method]:
    """The side-by-side methods plus the other bounds and the synchronous baselines."""
    first, *rest = side_by_side(state, copy)
    return [first, m.FreshClone(tensors), m.RawWrite(copy), m.RawWrite(copy, direct=True),
            m.TorchSave(state), m.DcpSave(state), m.DcpAsyncSave(state, "default"), *rest]


def on_device(value, device: str):
    """``value`` (a nested state dict) with every tensor moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: on_device(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(on_device(v, device) for v in value)
    return value


def daemon_idle_pss(pid: int) -> int:
    """PSS of an idle daemon and its writers, without the pool (shared memory)."""
    return sum(procmem.read_pss(p) for p in procmem.tree(pid))


def on_huge_pages(bench: Bench, section: dict, state: dict, pool: int, writers: int,
                  watch: procmem.MemWatch) -> None:
    """The default torch-format save once more, with a daemon whose staging pool lies in a
    tmpfs mounted here with huge pages (``--pool-dir``; needs root, else left out)."""
    from bench_write_path import huge_page_tmpfs

    with huge_page_tmpfs(pool + (64 << 20)) as huge_dir:
        if huge_dir is None:
            return
        os.environ["CKPTD_POOL_DIR"] = huge_dir
        daemon = None
        try:
            daemon = bench.daemon = Daemon(bench.outdir, pool, writers)
            watch.track(daemon.pid)
            method = m.CkptdTorch(state)
            method.name += " (pool on huge pages)"
            section["results"].append(asdict(bench.run(method)))
            section["huge_pool_dir"] = huge_dir
        finally:
            os.environ.pop("CKPTD_POOL_DIR", None)
            if daemon is not None:
                daemon.stop()
            bench.daemon = None


def run_suite(device: str, load: str, total_bytes: int, outdir: str, repeats: int,
              writers: int, only: set[str] | None, full: bool, huge: bool = False) -> dict:
    """Build the ``load`` state dict on ``device`` and measure the methods; the section."""
    print(f"[{device}, {load}] building a {total_bytes / GiB:.3f} GiB state dict ...", flush=True)
    state, mix = workload.build(load, total_bytes, device="cpu")
    if device != "cpu":
        state = on_device(state, device)
    tensors = workload.tensors_of(state)
    watch = procmem.MemWatch([os.getpid()])
    section: dict = {"device": device, "workload": load, "mix": asdict(mix),
                     "leaves": workload.leaves_of(state), "results": [],
                     "load_start": loadavg()}
    daemon = None
    try:
        bench = Bench(state, mix.total_bytes, outdir, repeats, device, watch)
        section["baseline_step_s"] = bench.measure_baseline_step()
        section["step_matmuls"] = bench.step.matmuls
        print(f"  baseline training step {section['baseline_step_s']:.3f}s", flush=True)
        copy = m.PreallocatedCopy(tensors, one_call=True)
        chosen = full_methods(state, tensors, copy) if full else side_by_side(state, copy)
        copy.prepare()  # kept for the raw-disk methods, which write its bytes
        copy.start("")
        bench.ref_copy, bench.ref_raw = copy, m.RawWrite(copy)
        copy.prepare = lambda: None  # type: ignore[method-assign]
        close_copy = copy.close
        copy.close = lambda: None  # type: ignore[method-assign]
        pool = -(-int(1.05 * mix.total_bytes) // (1 << 20)) << 20  # 1.05x, whole MiB
        for method in chosen:
            if only and not any(chosen_by(key, method.name) for key in only):
                continue
            if method.name.startswith("ckptd") and daemon is None:
                daemon = Daemon(outdir, pool, writers)
                bench.daemon = daemon
                section["daemon"] = {"pid": daemon.pid, "pool_bytes": pool, "writers": writers,
                                     "idle_pss": daemon_idle_pss(daemon.pid)}
                watch.track(daemon.pid)
            if method.name.startswith("ckptd"):
                m.stop_dcp_checkpoint_process()  # DCP's helper must not linger in ckptd's numbers
            try:
                section["results"].append(asdict(bench.run(method)))
            except Exception as exc:  # a baseline broken on this torch must not sink the rest
                why = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                print(f"    FAILED: {why}", flush=True)
                section.setdefault("failed", []).append({"method": method.name, "error": why})
        if huge and device == "cpu":
            if daemon is not None:
                daemon.stop()
                daemon = None
            on_huge_pages(bench, section, state, pool, writers, watch)
        close_copy()
        m.stop_dcp_checkpoint_process()
        section["baseline_step_end_s"] = bench.measure_baseline_step(3)
        section["caches_dropped"] = bench.caches_dropped
    finally:
        if daemon is not None:
            daemon.stop()
        watch.close()
    section["load_end"] = loadavg()
    return section


# ---------------------------------------------------------------- report

def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"


def render_section(section: dict) -> list[str]:
    results = [Result(**r) for r in section["results"]]
    total = section["mix"]["total_bytes"]
    by_name = {r.name: r for r in results}
    bound = next((r for r in results if r.name.startswith(("memcpy", "pinned D2H"))), None)
    disk = by_name.get("raw write + fsync")
    mcopy = bound.blocking_s if bound else None
    raw = disk.durable_s if disk else None
    base = section["baseline_step_s"]
    lines = [
        f"State dict: {total / GiB:.3f} GiB in {section['mix']['tensors']} tensors "
        f"({section['mix']['large']} large, {section['mix']['medium']} medium, "
        f"{section['mix']['small']} small) + {section.get('leaves', '?')} non-tensor leaves; "
        "by dtype: "
        + ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in section["mix"]["by_dtype"].items()) + ".",
        f"Training step with nothing in flight: {base:.3f} s (median; "
        f"{section['baseline_step_end_s']:.3f} s re-measured at the end): "
        f"{section.get('step_matmuls', 4)} 1024² matmuls as the forward/backward (calibrated "
        "to 3× the update), then an in-place update of every tensor.", ""]
    failed = [f"- **{f['method']} failed** on this machine and is left out: {f['error']}"
              for f in section.get("failed", [])]
    lines += failed + ([""] if failed else [])
    lines += blocking_headline(section, results)
    lines += ["", "What the trainer waits in all, the step beside the write, memory:", ""]
    lines += side_by_side_table(section, results, total)
    lines += ["", "Every measure of every method:", "",
        "| method | blocking s | durable s | durable GB/s | blocking / memcpy | durable / raw disk "
        "| step overlapping the save s (× same step just before) | durable while training s | trainer peak RSS GiB "
        "(+ over pre-save) | helpers peak RSS GiB | job unique peak GiB (+ over pre-save) "
        "| bytes on disk |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        gbps = total / r.durable_s / GB if r.durable_s else (total / r.blocking_s / GB)
        blocking_ratio = (f"{r.blocking_ratio:.2f}×" if r.blocking_ratio
                          else ratio(r.blocking_s, mcopy))
        durable_ratio = (f"{r.durable_ratio:.2f}×" if r.durable_ratio
                         else ratio(r.durable_s, raw))
        step = (f"{r.step_after_s:.3f} ({r.step_ratio or r.step_after_s / base:.2f}×)"
                if r.step_after_s is not None else "–")
        lines.append(
            f"| {r.name} | {r.blocking_s:.3f} | {fmt(r.durable_s)} | "
            f"{gbps:.2f}{'' if r.durable_s else ' (copy)'} | {blocking_ratio} | "
            f"{durable_ratio} | {step} | {fmt(r.durable_with_step_s)} | "
            f"{r.trainer_peak_gib:.2f} (+{r.trainer_extra_gib:.2f}) | {r.helpers_peak_gib:.2f} | "
            f"{r.unique_peak_gib:.2f} (+{r.unique_extra_gib:.2f}) | "
            f"{r.bytes_on_disk / GiB:.3f} GiB |")
    lines += ["", "Per-run times of the idle runs, in seconds, with the load average when the "
              "method started:", ""]
    lines += [f"- {r.name} (load {r.load}): blocking {r.blocking_runs}"
              + (f", durable {r.durable_runs}" if r.durable_s else "")
              + (f", 1st step after save {r.step_runs}" if r.step_runs else "")
              + (f"; memcpy bound in the same slots {r.ref_copy_runs}" if r.ref_copy_runs else "")
              + (f", raw disk right before {r.ref_raw_runs}" if r.ref_raw_runs else "")
              for r in results]
    best_copy = min([x for r in results for x in r.ref_copy_runs]
                    + (bound.blocking_runs if bound else []), default=None)
    best_raw = min([x for r in results for x in r.ref_raw_runs]
                   + (disk.durable_runs if disk else []), default=None)
    daemon_rows = [r for r in results if r.daemon_write_s is not None]
    if daemon_rows:
        lines += ["", "ckptd's own log, time from STAGED to durable (slowest file of the save, "
                  "median): " + "; ".join(f"{r.name} {r.daemon_write_s:.3f} s" for r in daemon_rows)
                  + "."]
    staging_rows = [r for r in results if r.daemon_stage_s]
    if staging_rows:
        lines += ["", "ckptd's staging, STAGE to every byte in the pool (its log; on CUDA the "
                  "daemon's device-to-host copies), median: " + "; ".join(
                      f"{r.name} {r.daemon_stage_s:.3f} s = {total / r.daemon_stage_s / GB:.2f} GB/s"
                      for r in staging_rows) + "."]
    lines += ["", "Key ratios, each the ratio of the medians against the bound measured in the "
              "same slots (targets: blocking ≤ 1.1× memcpy, durable ≤ 1.1× raw disk); for "
              "contrast, against the bound's own row and best run against best bound run:", ""]
    for r in results:
        if r.kind == "async" or r.name.startswith(("torch.save", "DCP save")):
            best_b = min(r.blocking_runs)
            best_d = min(r.durable_runs) if r.durable_runs else None
            lines.append(
                f"- {r.name}: blocking / memcpy = **{fmt(r.blocking_ratio, 2)}×** "
                f"({ratio(r.blocking_s, mcopy)} against the bound's own row, "
                f"{ratio(best_b, best_copy)} best / best); durable / raw disk = "
                f"**{fmt(r.durable_ratio, 2)}×** ({ratio(r.durable_s, raw)} against the raw "
                f"row, {ratio(best_d, best_raw)} best / best)")
    return lines


def spread(runs: list) -> str:
    """``median (min–max)`` of a list of seconds."""
    if not runs:
        return "–"
    return f"{statistics.median(runs):.3f} ({min(runs):.3f}–{max(runs):.3f})"


#: What the default save is compared with besides the bound: the fastest stock setup.
STOCK = "DCP async_save (process, shm stager reused)"


def blocking_headline(section: dict, results: list[Result]) -> list[str]:
    """The save call against the memcpy bound of the same slots, and zero-stall calls
    against their per-tensor target."""
    tensors = section["mix"]["tensors"]
    stock = next((r for r in results if r.name == STOCK), None)
    bound = next((r for r in results if r.kind == "bound"), None)
    lines = ["**Blocking (the save call), against a memcpy bound measured in the same slots.** "
             "Right before every timed save, after the same clean-up, page-cache drop, "
             "garbage collection and one untimed copy (which absorbs the drop's aftermath), "
             "the benchmark copies the same tensors into a preallocated, "
             "pre-faulted shared-memory buffer in ckptd's pool layout with one "
             "`torch._foreach_copy_` into views made once (the bytes moved and nothing else); "
             "the ratio is median(save call) / median(those bound runs), and the bound's own "
             "median and min–max are shown beside it."
             + (f" Measured alone at the start, the bound took {spread(bound.blocking_runs)} s."
                if bound else ""), "",
             "| method | save call s, median (min–max) | memcpy bound s, same slots, median "
             "(min–max) | call / bound (ratio of medians) | over the bound, µs a tensor "
             "| call / stock DCP call |", "|---|---|---|---|---|---|"]
    for r in results:
        if r.kind != "async" or "zero_stall" in r.name or not r.ref_copy_runs:
            continue
        over = (r.blocking_s - statistics.median(r.ref_copy_runs)) / tensors * 1e6
        lines.append(f"| {r.name} | {spread(r.blocking_runs)} | {spread(r.ref_copy_runs)} | "
                     f"**{fmt(r.blocking_ratio, 2)}×** | {over:.1f} | "
                     f"{ratio(r.blocking_s, stock.blocking_s) if stock else '–'} |")
    target = 0.005 + 5e-6 * tensors
    zero = [r for r in results if "zero_stall" in r.name]
    if zero:
        lines += ["", f"**Zero-stall calls** against the target 5 ms + 5 µs a tensor "
                  f"({tensors} tensors: {target * 1e3:.1f} ms):", "",
                  "| method | call ms, median (min–max) | call / target | call + guard ms "
                  "(runs with a step) |", "|---|---|---|---|"]
        for r in zero:
            runs = [x * 1e3 for x in r.blocking_runs]
            lines.append(f"| {r.name} | {statistics.median(runs):.1f} ({min(runs):.1f}–"
                         f"{max(runs):.1f}) | {r.blocking_s / target:.2f}× | "
                         f"{fmt(r.wait_total_s * 1e3 if r.wait_total_s is not None else None, 1)} |")
    return lines


def side_by_side_table(section: dict, results: list[Result], total: int) -> list[str]:
    """The comparison the trainer cares about: what it waits in total, and its next step."""
    daemon = section.get("daemon", {})
    lines = ["| method | trainer waits s (call + guard) | waits / memcpy | of which guard s "
             "| step overlapping the save (× normal step) | durable s | durable / raw disk "
             "| daemon + writers + pool peak PSS (÷ state) | job peak PSS GiB (+ over pre-save) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.kind != "async" and not r.name.startswith(("memcpy", "pinned D2H")):
            continue
        bound = r.kind == "bound"
        waits = r.blocking_s if bound else r.wait_total_s
        step = (f"{r.step_after_s:.3f} ({r.step_ratio:.2f}×)"
                if r.step_after_s is not None and r.step_ratio else "–")
        tree = (f"{r.daemon_peak_gib:.2f} GiB ({r.daemon_peak_gib * GiB / total:.2f}×)"
                if r.daemon_peak_gib else "–")
        lines.append(
            f"| {r.name} | {fmt(waits)} | {'1.00× (the bound)' if bound else fmt(r.wait_ratio, 2) + '×'} "
            f"| {fmt(r.guard_s)} | {step} | {fmt(r.durable_s)} | "
            f"{fmt(r.durable_ratio, 2) + '×' if r.durable_ratio else '–'} | {tree} | "
            f"{r.unique_peak_gib:.2f} (+{r.unique_extra_gib:.2f}) |")
    if daemon:
        lines += ["", f"ckptd: `--pool-size {daemon['pool_bytes']}` "
                  f"({daemon['pool_bytes'] / total:.2f}× the state), {daemon['writers']} writers; "
                  f"idle daemon + writers before any save: "
                  f"{daemon.get('idle_pss', 0) / (1 << 20):.0f} MiB PSS without the pool."]
    return lines


def render(report: dict) -> str:
    facts = report["facts"]
    lines = [
        "# ckptd save benchmark: results", "",
        f"Measured {report['date']} by `{report['command']}` "
        f"({report['wall_s']:.0f} s wall).", "",
        "## Machine", "",
        f"- CPU: {facts['cpu']}, {facts['cores']} cores (torch uses {facts['torch_threads']} threads); "
        f"RAM {facts['mem_total_gib']} GiB; kernel {facts['kernel']}; Python {facts['python']}, "
        f"torch {facts['torch']}.",
        *([f"- GPU: {facts['gpu']}."] if facts.get("gpu") else []),
        f"- Checkpoint directory: {facts['workdir']} on {facts['disk']}.",
        f"- Code measured: commit {facts.get('code', '?')}.",
        f"- Load average (1/5/15 min) at start {report['load_start']}, at end {report['load_end']} "
        "(the machine is shared with other engineers running tests).",
        f"- Page cache dropped before every timed run: "
        f"{'yes' if report.get('caches_dropped') else 'no (not permitted here)'}.",
        f"- Each figure is the median of {report['repeats']} runs after one warm-up; the step "
        "runs and the idle runs are separate.", ""]
    for section in report["sections"]:
        lines += [f"## {section['device'].upper()} state dict, `{section.get('workload', 'mix')}` "
                  "workload", ""]
        lines += render_section(section)
        if "daemon" in section:
            d = section["daemon"]
            lines += ["", f"ckptd ran as `python -m ckptd serve --writers {d['writers']} "
                          f"--pool-size {d['pool_bytes']}` (pid {d['pid']})."]
        lines.append("")
    for skipped in report.get("skipped", []):
        lines += [f"## {skipped['device'].upper()}: skipped", "", skipped["why"], ""]
    lines += ["## Column notes", "",
              "- *trainer waits (call + guard)*: what the training loop waits in total for a "
              "save, measured in the runs with a training step: the save call, plus what "
              "`before_update` waited right before the step's in-place updates (ckptd "
              "zero-stall: `wait_for_staging()`, which `guard_optimizer` calls from an optimizer "
              "pre-hook; torchtitan's pattern: `staging_completion.result()`; nothing for the "
              "others). *waits / memcpy* is the median of that total over the median of the "
              "memcpy bound measured in the same slots (right before each save call).",
              "- *step overlapping the save*: the training step started as soon as the save "
              "call returned (its forward/backward overlaps background staging and the write), "
              "over the same step run with nothing in flight right before.",
              "- *daemon + writers + pool peak PSS*: sampled every 0.25 s over ckptd's daemon and "
              "its writers: Σ (Pss_Anon + Pss_File) + the pool's resident shared memory once.",
              "- *blocking / memcpy* and *durable / raw disk*: for every timed run of a save method, "
              "a raw write + fsync is measured before it and the memcpy bound right before its "
              "save call, after the same clean-up (the machine is shared, so load drifts); each "
              "column is the ratio of the medians, median(method) / median(bound runs). A median "
              "of per-run ratios is not used: it flatters whenever one slow bound run pairs with "
              "a fast save.",
              "- *blocking*: until the call returns (training may go on). For synchronous methods "
              "it equals *durable*.",
              "- *durable*: until files are fsynced and committed (ckptd: "
              "`maybe_finalize_async_calls(blocking=True)` / `finalize_async_save(blocking=True)` "
              "returned; DCP async: the returned future completed). Measured in runs without a "
              "training step.",
              "- *1st step after save*: a fixed workload (1024² matmuls standing in for the "
              "forward/backward, calibrated to last 3× the update, then an in-place `add_` "
              "on every tensor of the state dict) started as soon as the save returned, in "
              "separate runs; the ratio is the median of step-after-save / the same step run "
              "with nothing in flight right before that save. *durable while training* is the "
              "time to durable in those runs.",
              "- *trainer peak RSS*: the trainer's VmHWM during the save (reset before it); it "
              "includes shared-memory pages the trainer maps (ckptd's staging pool is mapped "
              "with MAP_POPULATE, so all of it counts here and again in the daemon).",
              "- *helpers peak RSS*: sum of VmHWM of the processes doing the work (ckptd daemon + "
              "writers; DCP's checkpoint process); shared pages count in each.",
              "- *job peak PSS* (*job unique peak*): sampled every 0.25 s from a separate process "
              "over the trainer and all its descendants: Σ (Pss_Anon + Pss_File) + max RssShmem "
              "(shared memory counted once). "
              "*+ over pre-save* subtracts the same measure just before the save; memory a method "
              "holds between saves (ckptd's pool, DCP's cached shm stager) is in the peak but "
              "not in the *+*.", ""]
    if report.get("interpretation"):
        lines += ["## Interpretation", "", report["interpretation"].strip(), ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def default_workdir() -> str:
    """A temp directory on a real disk (not tmpfs)."""
    for candidate in (tempfile.gettempdir(), "/var/tmp", os.getcwd()):
        if mount_of(candidate)[2] not in ("tmpfs", "ramfs", "overlay?"):
            return candidate
    return os.getcwd()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=2.0, help="state dict size (default 2.0)")
    p.add_argument("--workload", choices=("training", "mix", "both"), default="both",
                   help="state dict(s) to measure (default both: every method on the "
                        "realistic 'training' one, the side-by-side set on 'mix')")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per method (median)")
    p.add_argument("--out", default=None, help="write the Markdown report here (and .json beside)")
    p.add_argument("--quick", action="store_true", help="64 MiB state dict, 2 repeats (smoke run)")
    p.add_argument("--workdir", default=None, help="parent of the checkpoint directory "
                   "(default: the temp dir if it is on a real disk)")
    p.add_argument("--writers", type=int, default=2, help="ckptd writer processes")
    p.add_argument("--only", default="", help="comma-separated substrings of method names "
                   "(a leading '=': the whole name)")
    p.add_argument("--no-gpu", action="store_true", help="skip the CUDA section")
    p.add_argument("--no-cpu", action="store_true",
                   help="skip the CPU section (on a GPU machine whose time is short: the CUDA "
                        "methods alone)")
    p.add_argument("--huge-pool", action="store_true",
                   help="also the default torch-format save with ckptd's pool in a tmpfs with "
                        "huge pages, which the benchmark mounts (root)")
    p.add_argument("--interpretation", default=None,
                   help="file whose text goes under 'Interpretation' in the report")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render a report from the JSON a previous run wrote "
                        "(e.g. to add --interpretation), measuring nothing")
    return p.parse_args(argv)


def rerender(args: argparse.Namespace) -> int:
    """Write the Markdown report again from a previous run's JSON."""
    with open(args.render) as f:
        report = json.load(f)
    if args.interpretation:
        with open(args.interpretation) as f:
            report["interpretation"] = f.read()
    text = render(report)
    write_report(args.out, text, report)
    if not args.out:
        print(text)
    return 0


def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)  # also when started in the background
    args = parse_args(argv)
    if args.render:
        return rerender(args)
    if args.quick:
        args.size_gib, args.repeats = 1 / 16, min(args.repeats, 2)  # 64 MiB
    workdir = args.workdir or default_workdir()
    if mount_of(workdir)[2] in ("tmpfs", "ramfs"):
        print(f"warning: {workdir} is on {mount_of(workdir)[2]}, not a disk", file=sys.stderr)
    outdir = tempfile.mkdtemp(prefix="ckpt-bench-out-", dir=workdir)
    rundir = tempfile.mkdtemp(prefix="ckpt-bench-run-")
    started = time.time()
    report: dict = {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                    "command": "python " + " ".join([os.path.relpath(__file__), *sys.argv[1:]]),
                    "facts": machine_facts(outdir), "load_start": loadavg(),
                    "repeats": args.repeats, "sections": [], "skipped": []}
    only = {s.strip().lower() for s in args.only.split(",") if s.strip()} or None
    total = int(args.size_gib * GiB)
    try:
        init_single_process_group(rundir)
        loads = ["training", "mix"] if args.workload == "both" else [args.workload]
        for load in ([] if args.no_cpu else loads):
            report["sections"].append(run_suite("cpu", load, total, outdir, args.repeats,
                                                args.writers, only, full=load == loads[0],
                                                huge=args.huge_pool))
        if args.no_cpu:
            report["skipped"].append({"device": "cpu", "why": "Skipped with --no-cpu."})
        if args.no_gpu:
            report["skipped"].append({"device": "cuda", "why": "Skipped with --no-gpu."})
        elif not torch.cuda.is_available():
            report["skipped"].append({"device": "cuda", "why": (
                f"No CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}"
                f"{', a CPU-only build' if torch.version.cuda is None else ''}). On a GPU machine "
                "this section measures a pinned device-to-host copy into a preallocated "
                "page-locked buffer as the lower bound, and ckptd receiving CUDA tensors "
                "(IPC handles, D2H copy by the daemon).")})
        else:
            for load in loads:
                report["sections"].append(run_suite("cuda", load, total, outdir, args.repeats,
                                                    args.writers, only, full=False))
    finally:
        m.remove_tree(outdir)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        m.remove_tree(rundir)
    report["load_end"] = loadavg()
    report["caches_dropped"] = all(s.get("caches_dropped") for s in report["sections"])
    report["wall_s"] = time.time() - started
    if args.interpretation:
        with open(args.interpretation) as f:
            report["interpretation"] = f.read()
    publish(args.out, render(report), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
