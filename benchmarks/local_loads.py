"""Load of a local checkpoint from the daemon's memory tier against a load from local disk.

One node, one rank, a real ``ckptd serve`` (``--local-dir`` on this machine's disk) and
real trainer processes; ``bench_local.py loads`` runs it. For each part size, in rounds
(so drift hits both sides alike):

1. a trainer saves a part of the size (the ``training`` mix of ``workload.py``) with
   ``LocalCheckpointManager`` and exits;
2. a *restarted trainer* (a new process; the daemon lived on, so it keeps the part in its
   staging pool) runs ``find_latest()`` + ``load()`` a few times: the memory tier
   (``last_load_report["source"] == "daemon_memory"`` is checked). Beside it, in the same
   process, memcpy of the part's bytes into a fresh buffer (the floor of any load that
   hands back fresh tensors);
3. the daemon restarts (its memory is gone, its disk kept), and another trainer loads
   from local disk: the first ``find_latest()`` (the restarted daemon takes the note its
   predecessor left beside the part it verified, or reads the part in full where there is
   none) is recorded, then loads alternate **cold** (the part's pages dropped from the
   page cache with ``posix_fadvise(DONTNEED)`` just before ``load()``) and **warm** (the
   pages left where the previous load put them). Beside them, a plain buffered read of
   the same file into a fresh buffer, cold and warm.

Every figure is ``load()``'s wall time (what ``last_load_report["seconds"]`` says); the
headline is the ratio of the medians (disk load time / memory load time = memory rate /
disk rate), with each side's spread (min–max of its runs). Runs of the trainer functions
happen in subprocesses (``python local_loads.py --trainer ...``) that print one JSON line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MiB = 1 << 20
SESSION = "bench"


# ================================================================ trainer side

def _manager(root: str):
    from ckpt_client import LocalCheckpointManager

    return LocalCheckpointManager(root, session_id=SESSION)


def trainer_save(root: str, part_bytes: int, iteration: int) -> dict:
    """Save one part of about ``part_bytes`` (synchronously: durable and committed)."""
    sys.path.insert(0, HERE)
    import workload
    from ckpt_client import BasicTensorAwareStateDict

    state, mix = workload.build_training_state(part_bytes)
    if mix.total_bytes < 0.97 * part_bytes:  # the mix rounds its tensors down: ask for more
        state, mix = workload.build_training_state(part_bytes * part_bytes // mix.total_bytes)
    t0 = time.perf_counter()
    _manager(root).save(BasicTensorAwareStateDict(state), iteration)
    return {"save_s": time.perf_counter() - t0, "tensors": mix.tensors,
            "part_bytes": mix.total_bytes}


def _timed_load(root: str) -> dict:
    manager = _manager(root)
    t0 = time.perf_counter()
    manager.find_latest()
    t1 = time.perf_counter()
    state, _ = manager.load()
    t2 = time.perf_counter()
    del state
    report = manager.last_load_report
    return {"find_s": t1 - t0, "load_s": t2 - t1, "source": report["source"],
            "bytes": report["bytes"], "path": _own_path(manager)}


def _own_path(manager) -> str | None:
    part = manager._found.own_parts.get(0)  # the benchmark reads the file it loaded
    return part.path if part is not None else None


def _fresh_copy_s(nbytes: int) -> float:
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        torch.empty(nbytes, dtype=torch.uint8).copy_(source)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drop_cached(path: str) -> None:
    """Drop ``path``'s pages from the page cache (clean pages: the part is fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _raw_read_s(path: str) -> float:
    import torch

    t0 = time.perf_counter()
    size = os.path.getsize(path)
    view, done = memoryview(torch.empty(size, dtype=torch.uint8).numpy()), 0
    with open(path, "rb", buffering=0) as f:
        while done < size:
            done += f.readinto(view[done:])
    return time.perf_counter() - t0


def trainer_memory(root: str, repeats: int) -> dict:
    """Loads by a restarted trainer whose daemon still holds the part."""
    loads = [_timed_load(root) for _ in range(repeats)]
    return {"loads": loads, "memcpy_fresh_s": _fresh_copy_s(loads[0]["bytes"])}


def trainer_disk(root: str, repeats: int) -> dict:
    """Loads from disk after a daemon restart: the first find_latest, then cold/warm."""
    first = _timed_load(root)
    cold, warm, raw_cold, raw_warm = [], [], [], []
    for _ in range(repeats):
        drop_cached(first["path"])
        cold.append(_timed_load(root))
        warm.append(_timed_load(root))
        drop_cached(first["path"])
        raw_cold.append(_raw_read_s(first["path"]))
        raw_warm.append(_raw_read_s(first["path"]))
    return {"first": first, "cold": cold, "warm": warm, "raw_cold_s": raw_cold,
            "raw_warm_s": raw_warm, "read_mode": _read_mode()}


def _read_mode() -> str:
    """How this process's loads read the part: what the loader decided for its filesystem."""
    try:
        from ckpt_client.local import part_io
    except ImportError:  # a tree from before direct reads
        return "buffered (page cache; the loader before O_DIRECT reads)"
    return "direct (O_DIRECT)" if any(part_io._modes.values()) else "buffered (page cache)"


# ================================================================ the run

class Daemon:
    """One ``ckptd serve`` with its local directory (restartable, disk kept)."""

    def __init__(self, workdir: str, pool_bytes: int) -> None:
        self.workdir = workdir
        self.socket = os.path.join(workdir, "ckptd.sock")
        self.local = os.path.join(workdir, "local")
        self.pool_bytes = pool_bytes
        self.process: subprocess.Popen | None = None
        os.makedirs(self.local, exist_ok=True)

    def start(self) -> None:
        from ckptd import protocol

        log = open(os.path.join(self.workdir, "ckptd.log"), "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--socket", self.socket, "--pool-size",
             str(self.pool_bytes), "--writers", "2", "--local-dir", self.local],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            env=_env(self.socket))
        log.close()
        problem = protocol.wait_until_ready(self.socket, self.process, 60.0)
        if problem:
            raise RuntimeError(f"ckptd {problem}; see {self.workdir}/ckptd.log")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def _env(socket_path: str) -> dict:
    return {**os.environ, "CKPTD_SOCKET": socket_path, "CKPTD_AUTO_START": "0",
            "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}


def _trainer(daemon: Daemon, *args) -> dict:
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--trainer", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env=_env(daemon.socket),
                          timeout=600)
    if done.returncode:
        raise RuntimeError(f"trainer {args[0]} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_size(part_mib: int, rounds: int, repeats: int, workdir: str) -> dict:
    """Every round of one part size (see the module docstring)."""
    part = part_mib * MiB
    daemon = Daemon(workdir, pool_bytes=part + part // 4 + 64 * MiB)
    out: dict = {"part_mib": part_mib, "rounds": []}
    root = os.path.join(daemon.local, "ckpt")
    try:
        daemon.start()
        for iteration in range(1, rounds + 1):
            print(f"  {part_mib} MiB round {iteration}: save, memory loads, restart, disk loads",
                  flush=True)
            saved = _trainer(daemon, "save", root, part, iteration)
            memory = _trainer(daemon, "memory", root, repeats)
            daemon.stop()
            daemon.start()
            disk = _trainer(daemon, "disk", root, repeats)
            out["rounds"].append({"save": saved, "memory": memory, "disk": disk})
    finally:
        daemon.stop()
    return out


def _spread(values: list) -> str:
    return f"{min(values):.4f}–{max(values):.4f}"


def summarize(size: dict) -> dict:
    """Medians, spreads and the ratios of one size."""
    rounds = size["rounds"]
    memory = [l for r in rounds for l in r["memory"]["loads"]]
    cold = [l for r in rounds for l in r["disk"]["cold"]]
    warm = [l for r in rounds for l in r["disk"]["warm"]]
    sources = {l["source"] for l in memory}, {l["source"] for l in cold + warm}
    nbytes = memory[0]["bytes"]
    med = lambda loads, key="load_s": statistics.median(l[key] for l in loads)
    both = lambda loads: [l["find_s"] + l["load_s"] for l in loads]
    s = {"bytes": nbytes, "tensors": rounds[0]["save"]["tensors"],
         "sources": [sorted(sources[0]), sorted(sources[1])],
         "memory_s": med(memory), "memory_runs": [l["load_s"] for l in memory],
         "cold_s": med(cold), "cold_runs": [l["load_s"] for l in cold],
         "warm_s": med(warm), "warm_runs": [l["load_s"] for l in warm],
         "memory_total_s": statistics.median(both(memory)),
         "cold_total_s": statistics.median(both(cold)),
         "warm_total_s": statistics.median(both(warm)),
         "first_find_s": [r["disk"]["first"]["find_s"] for r in rounds],
         "memcpy_fresh_s": statistics.median(r["memory"]["memcpy_fresh_s"] for r in rounds),
         "raw_cold_s": statistics.median(x for r in rounds for x in r["disk"]["raw_cold_s"]),
         "raw_warm_s": statistics.median(x for r in rounds for x in r["disk"]["raw_warm_s"]),
         "save_s": [round(r["save"]["save_s"], 3) for r in rounds]}
    s["ratio_cold"] = s["cold_s"] / s["memory_s"]
    s["ratio_warm"] = s["warm_s"] / s["memory_s"]
    return s


def render(report: dict) -> str:
    """The Markdown section of RESULTS_LOCAL.md."""
    gb = lambda nbytes, seconds: f"{nbytes / seconds / 1e9:.2f}"
    lines = [
        "## Memory tier against local disk (one node)", "",
        f"Measured {report['date']} by `{report['command']}` under `/work/bin/texcl`. One "
        f"`ckptd serve` (2 writers, `--local-dir` on {report['filesystem']}), one rank; part = "
        f"the `training` mix of `workload.py`; {report['rounds']} rounds per size, each: save, "
        f"{report['repeats']} loads from memory by a restarted trainer, daemon restart, "
        f"{report['repeats']} cold + {report['repeats']} warm loads from disk. Times are "
        "`load()` alone (after `find_latest()`); GB/s = 10⁹ bytes/s; spreads are min–max of "
        f"the runs. Read mode of local parts: {report['read_mode']}. Machine: "
        f"{os.cpu_count()} cores; load average at start {report['load_start']}, at end "
        f"{report['load_end']}.", "",
        "| part | tensors | memory load s (spread) | GB/s | disk cold s (spread) | GB/s | "
        "**memory / cold disk** | disk warm s (spread) | GB/s | **memory / warm disk** | "
        "target |",
        "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["sizes"]:
        lines.append(
            f"| {s['bytes'] / MiB:.0f} MiB | {s['tensors']} | {s['memory_s']:.4f} "
            f"({_spread(s['memory_runs'])}) | {gb(s['bytes'], s['memory_s'])} | "
            f"{s['cold_s']:.4f} ({_spread(s['cold_runs'])}) | {gb(s['bytes'], s['cold_s'])} | "
            f"**{s['ratio_cold']:.2f}×** | {s['warm_s']:.4f} ({_spread(s['warm_runs'])}) | "
            f"{gb(s['bytes'], s['warm_s'])} | **{s['ratio_warm']:.2f}×** | ≥ 2 |")
    lines += ["", "Bounds and context, same runs (medians, seconds):", "",
              "| part | memcpy into a fresh buffer | memory load / memcpy | raw buffered read, "
              "cold | raw read, warm | find_latest + load: memory / cold / warm | first "
              "find_latest after a daemon restart (the note of the daemon that verified "
              "the part, or a full read) | save s |",
              "|---|---|---|---|---|---|---|---|"]
    for s in report["sizes"]:
        lines.append(
            f"| {s['bytes'] / MiB:.0f} MiB | {s['memcpy_fresh_s']:.4f} | "
            f"{s['memory_s'] / s['memcpy_fresh_s']:.2f}× | {s['raw_cold_s']:.4f} | "
            f"{s['raw_warm_s']:.4f} | {s['memory_total_s']:.4f} / {s['cold_total_s']:.4f} / "
            f"{s['warm_total_s']:.4f} | {', '.join(f'{x:.3f}' for x in s['first_find_s'])} | "
            f"{s['save_s']} |")
    lines += ["", f"Load sources seen (memory runs; disk runs): "
                  f"{[s['sources'] for s in report['sizes']]}."]
    return "\n".join(lines) + "\n"


def run(sizes: list[int], rounds: int, repeats: int, workdir: str | None) -> dict:
    """Measure every size in a scratch directory on this machine's disk."""
    from procmem import loadavg

    base = tempfile.mkdtemp(prefix="bench-loads-", dir=workdir)
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "rounds": rounds, "repeats": repeats, "load_start": loadavg(),
              "filesystem": _filesystem(base), "raw": []}
    try:
        for mib in sizes:
            raw = measure_size(mib, rounds, repeats, os.path.join(base, f"{mib}"))
            report["raw"].append(raw)
            shutil.rmtree(os.path.join(base, f"{mib}"), ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    report["sizes"] = [summarize(raw) for raw in report["raw"]]
    report["read_mode"] = ", ".join(sorted({r["disk"]["read_mode"] for raw in report["raw"]
                                            for r in raw["rounds"]}))
    report["load_end"] = loadavg()
    return report


def _filesystem(path: str) -> str:
    found = subprocess.run(["df", "--output=fstype,source", path], capture_output=True,
                           text=True).stdout.split()
    return " ".join(found[2:4]) if len(found) >= 4 else "unknown"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trainer"]:
        kind, root, *rest = sys.argv[2:]
        result = {"save": lambda: trainer_save(root, int(rest[0]), int(rest[1])),
                  "memory": lambda: trainer_memory(root, int(rest[0])),
                  "disk": lambda: trainer_disk(root, int(rest[0]))}[kind]()
        print(json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit("run through bench_local.py loads")
