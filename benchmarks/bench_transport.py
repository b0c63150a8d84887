"""Bulk transport for replication: plain tcp against authenticated and encrypted
candidates, on loopback and between two network namespaces (issue 12's measurement).

One run measures, side by side, the one-way throughput of ``--size-mib`` MiB in
``--chunk-mib`` MiB chunks from a sender process to a receiver process that lands the
bytes in a preallocated destination buffer, for every candidate in ``transports.py``
(plain tcp; tcp with a keyed tag per chunk; TLS 1.3 from ``ssl``; per-chunk AEAD from
``cryptography``; PyNaCl's AEGIS-128L and secretstream; ZeroMQ with and without CURVE), with
1, 2 and 4 parallel streams, the streams of one end as threads of one process or as
separate processes, on three paths:

- ``loopback``: both processes in the root namespace, 127.0.0.1;
- ``netns``: sender in node 0 and receiver in node 1 of a ``tests/netbed.py`` bed (veth
  pairs through a bridge, no rate limit);
- ``netns-<rate>``: the same with ``tc tbf rate <rate>`` on both ends of both links.

A second section times each keyed primitive without a network in 1 thread, 2 threads of
one process and 2 processes, which shows whether it releases the GIL.

Timing: both ends connect (and handshake) first; the parent then tells every sender to
go; the time is from the first sender's start to the last receiver's end (CLOCK_MONOTONIC
is one clock for every process and namespace). CPU seconds are each end's
``getrusage`` over the transfer; the CPU used by anything else on the machine during each
transfer (``/proc/stat`` minus ours) is recorded with it. Every receiver checks what it got
(headers and contents of each chunk), so a fast wrong transport cannot win.

Usage (as root for the namespace paths; without root they are reported as skipped)::

    python benchmarks/bench_transport.py --out benchmarks/RESULTS_TRANSPORT.md
    python benchmarks/bench_transport.py --quick                 # 32 MiB, 1 repeat
    python benchmarks/bench_transport.py --render benchmarks/RESULTS_TRANSPORT.json \\
        --interpretation notes.md --out benchmarks/RESULTS_TRANSPORT.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import resource
import selectors
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import transports  # noqa: E402
from procmem import loadavg, machine_cpu, process_cpu, top_cpu_users  # noqa: E402
from report import write_report  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SEED = 12
#: Bytes compared per chunk at the receiver (plus one whole chunk per stream).
CHECK_BYTES = 4096
#: Seconds a worker may take to start, bind or connect.
SETUP_TIMEOUT = 60.0
ALL_CONFIGS = [(1, "threads"), (2, "threads"), (4, "threads"), (2, "processes"),
               (4, "processes")]


# ============================================================== worker (one end)

def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _touch(view: memoryview, chunk: int) -> None:
    # New pages are expensive here; fault them in before the clock starts.
    zeros = bytes(chunk)
    for off in range(0, len(view), chunk):
        view[off:off + chunk] = zeros[:len(view) - off]


def _block(chunk: int) -> bytes:
    return random.Random(SEED).randbytes(chunk)


def _chunks(view: memoryview, streams: list[int], stream_bytes: int, chunk: int):
    """Per stream, the chunk views of that stream's slice of ``view``."""
    per = {}
    for i, s in enumerate(streams):
        base = i * stream_bytes
        per[s] = [view[base + off:base + off + chunk] for off in range(0, stream_bytes, chunk)]
    return per


def _fill_source(view: memoryview, streams, stream_bytes: int, chunk: int) -> None:
    block = _block(chunk)
    for s, chunks in _chunks(view, streams, stream_bytes, chunk).items():
        for k, c in enumerate(chunks):
            c[:] = block
            c[:16] = transports.header16(s, k)


def _check_destination(view: memoryview, streams, stream_bytes: int, chunk: int) -> None:
    block = _block(chunk)
    for s, chunks in _chunks(view, streams, stream_bytes, chunk).items():
        for k, c in enumerate(chunks):
            if c[:16] != transports.header16(s, k) or c[16:CHECK_BYTES] != block[16:CHECK_BYTES]:
                raise RuntimeError(f"stream {s} chunk {k}: wrong bytes arrived")
        if chunks[-1][16:] != block[16:]:
            raise RuntimeError(f"stream {s}: the last chunk differs from what was sent")


def _run_threads(target, items) -> None:
    errors = []

    def guarded(item):
        try:
            target(item)
        except BaseException as exc:  # reported by the worker, which then fails
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker_receive(cfg: dict) -> None:
    t = transports.transport(cfg["method"])
    t.load(transports.decode_secrets(cfg["secrets"]))
    streams, stream_bytes, chunk = cfg["streams"], cfg["stream_bytes"], cfg["chunk"]
    listeners = {s: t.listen(cfg["host"]) for s in streams}
    dest = memoryview(bytearray(stream_bytes * len(streams)))
    _touch(dest, chunk)
    per_stream = _chunks(dest, streams, stream_bytes, chunk)
    _emit({"ports": [t.port(listeners[s]) for s in streams]})
    conns, ends = {}, {}
    accepted = threading.Barrier(len(streams) + 1)

    def stream(s):
        conns[s] = t.accept(listeners[s])
        accepted.wait()
        t.recv(conns[s], s, per_stream[s])
        ends[s] = time.monotonic()
        t.end_recv(conns[s])

    failure = []

    def run_all():
        try:
            _run_threads(stream, streams)
        except BaseException as exc:  # raised below, in the main thread
            failure.append(exc)

    runner = threading.Thread(target=run_all)
    runner.start()
    try:
        accepted.wait(SETUP_TIMEOUT)
    except threading.BrokenBarrierError:
        runner.join()
        raise failure[0] if failure else TimeoutError("streams were not accepted in time")
    cpu0 = _cpu_seconds()  # the handshakes are behind us; a blocked recv costs nothing
    runner.join()
    cpu1 = _cpu_seconds()
    if failure:
        raise failure[0]
    negotiated = t.describe(conns[streams[0]])
    for conn in conns.values():
        t.close(conn)
    t.finish()
    _check_destination(dest, streams, stream_bytes, chunk)
    _emit({"t_end": max(ends.values()), "cpu": cpu1 - cpu0, "bytes": len(dest),
           "negotiated": negotiated})


def worker_send(cfg: dict) -> None:
    t = transports.transport(cfg["method"])
    t.load(transports.decode_secrets(cfg["secrets"]))
    streams, stream_bytes, chunk = cfg["streams"], cfg["stream_bytes"], cfg["chunk"]
    source = memoryview(bytearray(stream_bytes * len(streams)))
    _fill_source(source, streams, stream_bytes, chunk)
    per_stream = _chunks(source, streams, stream_bytes, chunk)
    conns = {s: t.connect(cfg["host"], port) for s, port in zip(streams, cfg["ports"])}
    _emit({"connected": True})
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no 'go' from the parent")
    cpu0, t0 = _cpu_seconds(), time.monotonic()
    def stream(s):
        t.send(conns[s], s, per_stream[s])
        t.end_send(conns[s])

    _run_threads(stream, streams)
    for conn in conns.values():
        t.close(conn)
    t.finish()  # ZeroMQ: returns once every queued frame is sent
    _emit({"t_start": t0, "t_done": time.monotonic(), "cpu": _cpu_seconds() - cpu0})


def worker_crypto(cfg: dict) -> None:
    secrets = transports.decode_secrets(cfg["secrets"])
    chunk, per_thread = cfg["chunk"], cfg["bytes_per_thread"]
    source = memoryview(bytearray(os.urandom(16 * chunk)))
    work = [transports.primitive(cfg["primitive"], secrets, chunk) for _ in range(cfg["threads"])]
    _emit({"ready": True})
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("no 'go' from the parent")
    cpu0, t0 = _cpu_seconds(), time.monotonic()

    def run(fn):
        for k in range(per_thread // chunk):
            off = (k % 16) * chunk
            fn(source[off:off + chunk], k)

    _run_threads(run, work)
    _emit({"t_start": t0, "t_end": time.monotonic(), "cpu": _cpu_seconds() - cpu0,
           "bytes": per_thread // chunk * chunk * len(work)})


def worker_main() -> int:
    cfg = json.loads(sys.stdin.readline())
    {"recv": worker_receive, "send": worker_send, "crypto": worker_crypto}[cfg["role"]](cfg)
    return 0


# ============================================================== parent

class Worker:
    """One worker process: JSON lines in and out, every read bounded by a timeout."""

    def __init__(self, popen: subprocess.Popen, log_path: str):
        self.popen, self.log_path, self.buffer = popen, log_path, b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(popen.stdout, selectors.EVENT_READ)

    def send(self, obj) -> None:
        line = obj if isinstance(obj, str) else json.dumps(obj)
        self.popen.stdin.write(line.encode() + b"\n")
        self.popen.stdin.flush()

    def read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker gave no answer within {timeout:.0f}s{self.log_tail()}")
            if self.selector.select(min(left, 0.5)):
                data = os.read(self.popen.stdout.fileno(), 65536)
                if not data:
                    raise RuntimeError(f"worker exited with {self.popen.wait()}{self.log_tail()}")
                self.buffer += data
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def log_tail(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-1500:]
        except FileNotFoundError:
            return ""
        return f"; its stderr:\n{tail}" if tail.strip() else ""

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.popen.stdin, self.popen.stdout):
            try:
                f.close()
            except OSError:
                pass
        self.selector.close()


class Path:
    """Where the two ends run: ``spawn(node)`` starts a worker in node 0 (sender) or 1."""

    def __init__(self, name: str, logdir: str, bed=None):
        self.name, self.logdir, self.bed = name, logdir, bed
        self.count = 0

    def host(self) -> str:
        return self.bed.nodes[1].ip if self.bed else "127.0.0.1"

    def spawn(self, node: int, env: dict) -> Worker:
        self.count += 1
        log_path = os.path.join(self.logdir, f"worker-{self.count}.log")
        argv = [sys.executable, os.path.abspath(__file__), "--worker"]
        with open(log_path, "wb") as log:
            options = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            if self.bed:
                popen = self.bed.popen(node, argv, env=env, **options)
            else:
                popen = subprocess.Popen(argv, env={**os.environ, **env}, start_new_session=True,
                                         **options)
        return Worker(popen, log_path)


def measure(path: Path, method: str, streams: int, mode: str, size: int, chunk: int,
            secrets: dict, timeout: float) -> dict:
    """One transfer of ``size`` bytes; returns seconds, GB/s and CPU, or an error."""
    stream_bytes = size // streams // chunk * chunk
    groups = [list(range(streams))] if mode == "threads" else [[s] for s in range(streams)]
    env = transports.transport(method).env(secrets)
    base = {"method": method, "stream_bytes": stream_bytes, "chunk": chunk, "secrets": secrets}
    workers: list[Worker] = []
    try:
        receivers = []
        for group in groups:
            w = path.spawn(1, env)
            workers.append(w)
            w.send({**base, "role": "recv", "host": path.host(), "streams": group})
            receivers.append(w)
        ports = {}
        for w, group in zip(receivers, groups):
            ports.update(zip(group, w.read(SETUP_TIMEOUT)["ports"]))
        senders = []
        for group in groups:
            w = path.spawn(0, env)
            workers.append(w)
            w.send({**base, "role": "send", "host": path.host(), "streams": group,
                    "ports": [ports[s] for s in group]})
            senders.append(w)
        for w in senders:
            w.read(SETUP_TIMEOUT)
        times0 = machine_cpu()
        for w in senders:
            w.send("go")
        got = [w.read(timeout) for w in receivers]
        sent = [w.read(timeout) for w in senders]
        times1 = machine_cpu()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for w in workers:
            w.kill()
    seconds = max(g["t_end"] for g in got) - min(s["t_start"] for s in sent)
    nbytes = sum(g["bytes"] for g in got)
    cpu_send, cpu_recv = sum(s["cpu"] for s in sent), sum(g["cpu"] for g in got)
    return {"bytes": nbytes, "seconds": seconds, "gbps": nbytes / seconds / 1e9,
            "cpu_send": cpu_send, "cpu_recv": cpu_recv,
            # getrusage of both ends is ours; the rest of the process time is others'.
            "other_cpu": max(0.0, times1["processes"] - times0["processes"] - cpu_send - cpu_recv),
            "interrupt_cpu": times1["interrupts"] - times0["interrupts"],
            "steal": times1["steal"] - times0["steal"],
            "negotiated": got[0].get("negotiated", "")}


def measure_crypto(primitive: str, layout: tuple[int, int], per_thread: int, chunk: int,
                   secrets: dict, logdir: str) -> dict:
    """``layout`` = (processes, threads per process), each thread ``per_thread`` bytes."""
    path = Path("crypto", logdir)
    procs, threads = layout
    workers = []
    try:
        for _ in range(procs):
            w = path.spawn(0, {})
            workers.append(w)
            w.send({"role": "crypto", "primitive": primitive, "threads": threads, "chunk": chunk,
                    "bytes_per_thread": per_thread, "secrets": secrets})
        for w in workers:
            w.read(SETUP_TIMEOUT)
        for w in workers:
            w.send("go")
        results = [w.read(300) for w in workers]
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        for w in workers:
            w.kill()
    seconds = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    return {"gbps": nbytes / seconds / 1e9, "cpu_per_gib": sum(r["cpu"] for r in results) / (nbytes / GiB)}


def self_check(secrets: dict, methods: list[str]) -> dict[str, str]:
    """Each tcp-framed secure candidate over a socketpair: the job's key must deliver the
    bytes intact, another job's key must be rejected. (TLS and CURVE reject a stranger in
    their handshakes, which their libraries own.)"""
    good = transports.decode_secrets(secrets)
    with tempfile.TemporaryDirectory() as tmp:
        stranger = transports.decode_secrets(transports.secrets_for(tmp))
    outcome = {}
    for method in methods:
        probe = transports.transport(method)
        if probe.security == "none" or isinstance(probe, (transports.Tls13, transports.Zmq)):
            continue
        verdicts = []
        for receiver_secrets in (good, stranger):
            sender, receiver = transports.transport(method), transports.transport(method)
            sender.load(good)
            receiver.load(receiver_secrets)
            a, b = socket.socketpair()
            src = [memoryview(bytearray(os.urandom(65536))) for _ in range(3)]
            dst = [memoryview(bytearray(65536)) for _ in range(3)]
            errors = []

            def receive():
                try:
                    receiver.recv(receiver.server_side(b), 0, dst)
                except Exception as exc:
                    errors.append(exc)
                finally:
                    b.close()

            thread = threading.Thread(target=receive)
            thread.start()
            try:
                sender.send(sender.client_side(a), 0, src)
            except OSError:
                pass  # the receiver gave up on a bad chunk and closed
            a.close()
            thread.join(30)
            intact = not errors and all(bytes(x) == bytes(y) for x, y in zip(src, dst))
            verdicts.append(intact)
        outcome[method] = ("ok" if verdicts == [True, False] else
                           f"FAILED (own key delivered: {verdicts[0]}, stranger's key delivered: "
                           f"{verdicts[1]})")
    return outcome


def gil_probe(primitive: str, secrets: dict, size: int = 256 * MiB, tries: int = 3) -> float:
    """Does ``primitive`` let other Python threads run while it works?

    One call on ``size`` bytes while another thread spins through Python bytecode and
    notes its longest stall. A call that holds the GIL stalls that thread for the whole
    call (share about 1.0); one that releases it, for little of it. The smallest share of
    ``tries`` calls is returned: other load on the machine can only make stalls longer.
    """
    fn = transports.primitive(primitive, transports.decode_secrets(secrets), size)
    data = memoryview(bytearray(size))
    _touch(data, 4 * MiB)
    fn(data[:MiB], 0)
    shares = []
    for k in range(tries):
        stall, running = [0.0], threading.Event()
        done = threading.Event()

        def spin():
            last = time.perf_counter()
            running.set()
            while not done.is_set():
                now = time.perf_counter()
                stall[0] = max(stall[0], now - last)
                last = now

        spinner = threading.Thread(target=spin)
        spinner.start()
        running.wait()
        t0 = time.perf_counter()
        fn(data, k + 1)
        call = time.perf_counter() - t0
        done.set()
        spinner.join()
        shares.append(min(1.0, stall[0] / call))
    return min(shares)


# ============================================================== machine facts

def machine_facts() -> dict:
    facts = {"python": platform.python_version(), "ssl": ssl.OPENSSL_VERSION,
             "kernel": platform.release(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        facts["cpu"] = info.split("model name")[1].split(":", 1)[1].split("\n")[0].strip()
        flags = set(info.split("\nflags")[1].split(":", 1)[1].split("\n")[0].split())
        facts["cpu_flags"] = " ".join(f for f in ("aes", "pclmulqdq", "vaes", "vpclmulqdq",
                                                   "avx2", "avx512f", "sha_ni") if f in flags)
    except (OSError, IndexError):
        pass
    for module, attr in (("cryptography", "__version__"), ("zmq", "__version__"),
                         ("nacl", "__version__"), ("blake3", "__version__")):
        try:
            facts[module] = getattr(__import__(module), attr)
        except ImportError:
            facts[module] = "not installed"
    try:
        import zmq

        facts["libzmq"] = zmq.zmq_version()
        from cryptography.hazmat.backends.openssl.backend import backend

        facts["cryptography_openssl"] = backend.openssl_version_text()
    except ImportError:
        pass
    return facts


# ============================================================== report

def _median(values):
    return statistics.median(values) if values else None


def summarize(report: dict) -> dict:
    """(path, method, streams, mode) -> medians and the paired ratio to plain tcp."""
    runs = report["runs"]
    keyed: dict = {}
    for r in runs:
        keyed.setdefault((r["path"], r["method"], r["streams"], r["mode"]), []).append(r)
    out = {}
    for key, rs in keyed.items():
        ok = [r for r in rs if "error" not in r]
        path, method, streams, mode = key
        base = {r["repeat"]: r for r in keyed.get((path, "tcp", streams, mode), []) if "error" not in r}
        ratios = [r["gbps"] / base[r["repeat"]]["gbps"] for r in ok if r["repeat"] in base]
        out[key] = {
            "gbps": _median([r["gbps"] for r in ok]),
            "ratio": _median(ratios),
            "send_cpu_gib": _median([r["cpu_send"] / (r["bytes"] / GiB) for r in ok]),
            "recv_cpu_gib": _median([r["cpu_recv"] / (r["bytes"] / GiB) for r in ok]),
            "other_cpu": sum(r["other_cpu"] for r in ok),
            "runs": [round(r["gbps"], 2) for r in ok],
            "errors": [r["error"] for r in rs if "error" in r],
            "negotiated": next((r["negotiated"] for r in ok if r.get("negotiated")), ""),
        }
    return out


def _cell(s: dict | None) -> str:
    if not s or s["gbps"] is None:
        return "error" if s and s["errors"] else "–"
    ratio = f" ({s['ratio']:.2f}×)" if s["ratio"] is not None else ""
    return f"{s['gbps']:.2f}{ratio}"


def _f(x, digits=2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def render(report: dict, interpretation: str = "") -> str:
    summary = summarize(report)
    facts, cfg = report["machine"], report["config"]
    paths = [p for p in report["paths"] if not report["skipped_paths"].get(p)]
    methods = [m for m in report["methods"] if m not in report["unavailable"]]
    security = report["security"]
    lines = [
        "# Bulk transport for replication: plain tcp against secure choices", "",
        f"Measured {report['date']} by `{report['command']}`: {cfg['size_mib']} MiB one way "
        f"in {cfg['chunk_mib']} MiB chunks, sender process → receiver process landing the bytes "
        f"in a preallocated buffer (checked after each transfer); median of {cfg['repeats']} "
        "runs; GB/s = 10⁹ bytes/s; (×) = paired ratio to plain tcp on the same path, streams and "
        "workers. CPU s/GiB = CPU seconds of that end (all its threads, or all its processes) "
        "per GiB moved.", "",
        f"Machine: {facts.get('cpu', '?')} ({facts.get('cpu_flags', '')}), {facts['cores']} "
        f"cores shared by both ends; kernel {facts['kernel']}; Python {facts['python']} with "
        f"{facts['ssl']}; cryptography {facts.get('cryptography')} "
        f"({facts.get('cryptography_openssl', '?')}); pyzmq {facts.get('zmq')} (libzmq "
        f"{facts.get('libzmq', '?')}); PyNaCl {facts.get('nacl')}; blake3 {facts.get('blake3')}.",
        f"Load average at start {report['load_start']}, at end {report['load_end']}. During the "
        f"{report['transfer_seconds_total']:.0f} s of transfers (of {2 * report['transfer_seconds_total']:.0f} "
        f"core-seconds), other processes used {report['other_cpu_total']:.0f} CPU s"
        + (f", interrupts (mostly the transfers' own network stack, not in the CPU columns) "
           f"{report['interrupt_cpu_total']:.0f} s, the hypervisor stole {report['steal_total']:.0f} s"
           if "interrupt_cpu_total" in report else "")
        + f". Longest-lived other CPU users over the whole run (short-lived test processes "
        f"of other engineers do not show here): "
        f"{', '.join(f'`{c}` {s} s' for c, s in report['other_users']) or 'none'}.", "",
        "Paths: **loopback** = both ends in the root namespace on 127.0.0.1; **netns** = sender "
        "in node 0, receiver in node 1 of a `tests/netbed.py` bed (each its own network "
        "namespace, veth pairs through a bridge, MTU 1500), no rate limit; "
        f"**netns {cfg['rate']}** = the same with `tc tbf rate {cfg['rate']}` (burst 4 ms, "
        "latency 50 ms) on both ends of both links.",
    ]
    for path, why in report["skipped_paths"].items():
        if why:
            lines.append(f"Path {path} skipped: {why}.")
    for method, why in report["unavailable"].items():
        lines.append(f"Not measured: {method}: {why}.")
    checks = report.get("self_check", {})
    if checks:
        failed = {m: v for m, v in checks.items() if v != "ok"}
        lines.append("Self-check before measuring (socketpair, 3 chunks): every tcp-framed "
                     "secure candidate delivered intact bytes under the job's key and rejected "
                     "another key's chunks." if not failed else f"Self-check FAILED: {failed}.")
    lines.append("")

    def pick(path, method, streams, mode="threads"):
        return summary.get((path, method, streams, mode))

    lines += ["## Summary", "",
              "GB/s (× plain tcp). 4 streams: one process per end, one thread per stream. "
              "CPU: loopback, 1 stream.", ""]
    head = ["method", "security"]
    for p in paths:
        head += [f"{p} 1 stream", f"{p} 4 streams"]
    head += ["send CPU s/GiB", "recv CPU s/GiB"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        row = [m, security[m]]
        for p in paths:
            row += [_cell(pick(p, m, 1)), _cell(pick(p, m, 4))]
        s = pick(paths[0], m, 1) if paths else None
        row += [_f(s and s["send_cpu_gib"]), _f(s and s["recv_cpu_gib"])]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")

    for p in paths:
        lines += [f"## {p}: every configuration", "",
                  "| method | streams | workers per end | GB/s | × tcp | send CPU s/GiB | "
                  "recv CPU s/GiB | runs (GB/s) |", "|---|---|---|---|---|---|---|---|"]
        for m in methods:
            for streams, mode in report["configs"][p]:
                s = pick(p, m, streams, mode)
                if s is None:
                    continue
                workers = "1 process" if mode == "threads" else f"{streams} processes"
                if s["gbps"] is None:
                    lines.append(f"| {m} | {streams} | {workers} | error: {s['errors'][0][:160]} "
                                 "| | | | |")
                    continue
                lines.append(f"| {m} | {streams} | {workers} | {s['gbps']:.2f} | {_f(s['ratio'])} "
                             f"| {_f(s['send_cpu_gib'])} | {_f(s['recv_cpu_gib'])} | {s['runs']} |")
        lines.append("")

    negotiated = {m: s["negotiated"] for (p, m, _, _), s in summary.items() if s["negotiated"]}
    if negotiated:
        lines += ["TLS as negotiated (checked by both ends): " +
                  "; ".join(f"{m}: {n}" for m, n in negotiated.items()) + ".", ""]

    if report.get("crypto"):
        per = cfg["crypto_mib"]
        stalls = report.get("gil_stall", {})
        lines += ["## The keyed primitives alone (no network): do they release the GIL?", "",
                  f"Each thread tags or seals {per} MiB in {cfg['chunk_mib']} MiB chunks into a "
                  "reused buffer (what a sender does per chunk; PyNaCl's bindings also copy in "
                  "and out). GB/s of all threads together, median of the runs. *Cores busy* = "
                  "the process's CPU seconds / wall seconds with 2 threads: about 1.0 when the "
                  "GIL serialises the threads, up to 2.0 (less what other work takes of the 2 "
                  "cores) when the work runs outside it. It is the robust column on a shared "
                  "machine; the GB/s columns move with the load. *Stall* = while one thread "
                  "makes one 256 MiB call, the longest time another thread could not run "
                  "Python, as a share of the call (the smallest of 3 calls per repeat, median "
                  "over repeats): near 1.0 (above 0.6) holds the GIL throughout, near 0 (below 0.25) releases it; in "
                  "between, the call releases it only for part (PyNaCl's copies hold it).", "",
                  "| primitive | library | 1 thread GB/s | 2 threads, 1 process GB/s | "
                  "2 processes GB/s | cores busy, 2 threads of 1 process | stall | "
                  "releases the GIL | CPU s/GiB (1 thread) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, by_layout in report["crypto"].items():
            med = {k: _median([r["gbps"] for r in v if "error" not in r]) for k, v in by_layout.items()}
            cpu = _median([r["cpu_per_gib"] for r in by_layout["1x1"] if "error" not in r])
            cores = _median([r["cpu_per_gib"] * r["gbps"] * 1e9 / GiB
                             for r in by_layout.get("1x2", []) if "error" not in r])
            stall = _median(stalls.get(name, []))
            if stall is not None:
                verdict = "yes" if stall < 0.25 else "no" if stall > 0.6 else "partly"
            else:
                verdict = "–" if cores is None else "yes" if cores >= 1.3 else "no"
            lines.append(f"| {name} | {report['primitive_library'][name]} | {_f(med.get('1x1'))} | "
                         f"{_f(med.get('1x2'))} | {_f(med.get('2x1'))} | {_f(cores)} | "
                         f"{_f(stall)} | {verdict} | {_f(cpu, 3)} |")
        lines.append("")
    if interpretation:
        lines += [interpretation.rstrip(), ""]
    return "\n".join(lines)


# ============================================================== main

def _exit_on_signal(signum: int, _frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks that clean up


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=512, help="bytes per transfer (MiB)")
    p.add_argument("--chunk-mib", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--paths", default="loopback,netns,netns-rate",
                   help="comma list of loopback, netns, netns-rate")
    p.add_argument("--rate", default="2gbit", help="tc rate of the netns-rate path")
    p.add_argument("--rate-configs", default="1,4",
                   help="streams measured on the rate-limited path (threads only)")
    p.add_argument("--methods", default="", help="comma list of substrings of method names")
    p.add_argument("--crypto-mib", type=int, default=None,
                   help="MiB per thread for the no-network section (default 256; 0 skips it)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per transfer")
    p.add_argument("--quick", action="store_true", help="32 MiB, 1 repeat, 32 MiB crypto")
    p.add_argument("--out", default=None, help="Markdown report (and .json beside)")
    p.add_argument("--render", default=None, help="re-render this JSON report, measure nothing")
    p.add_argument("--interpretation", default=None, help="Markdown appended to the report")
    args = p.parse_args(argv)
    interpretation = open(args.interpretation).read() if args.interpretation else ""
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        if interpretation:
            report["interpretation"] = interpretation
        text = render(report, report.get("interpretation", ""))
        print(text)
        write_report(args.out, text, report)
        return 0
    if args.quick:
        args.size_mib, args.repeats = 32, 1
    if args.crypto_mib is None:
        args.crypto_mib = 32 if args.quick else 256
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, _exit_on_signal)

    wanted = [s.strip() for s in args.methods.split(",") if s.strip()]
    all_methods = [cls.name for cls in transports.TRANSPORTS]
    methods = [m for m in all_methods if not wanted or any(w in m for w in wanted)]
    unavailable = {m: why for m in methods if (why := transports.transport(m).available())}
    size, chunk = args.size_mib * MiB, args.chunk_mib * MiB
    workdir = tempfile.mkdtemp(prefix="bench-transport-")
    secrets = transports.secrets_for(workdir)
    rate_path = f"netns {args.rate}"
    path_names = {"loopback": "loopback", "netns": "netns", "netns-rate": rate_path}
    chosen = [path_names[x.strip()] for x in args.paths.split(",") if x.strip()]
    configs = {name: ([(int(s), "threads") for s in args.rate_configs.split(",")]
                      if name == rate_path else ALL_CONFIGS) for name in chosen}
    report: dict = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__), *argv]),
        "config": {"size_mib": args.size_mib, "chunk_mib": args.chunk_mib, "repeats": args.repeats,
                   "rate": args.rate, "crypto_mib": args.crypto_mib},
        "machine": machine_facts(), "load_start": loadavg(), "paths": chosen,
        "configs": configs, "methods": methods, "unavailable": unavailable,
        "security": {m: transports.transport(m).security for m in methods},
        "skipped_paths": {}, "runs": [], "crypto": {}, "primitive_library": {},
    }
    report["self_check"] = self_check(secrets, [m for m in methods if m not in unavailable])
    print("self-check:", report["self_check"], flush=True)
    snapshot = process_cpu()
    beds = []
    paths: dict[str, Path] = {}
    try:
        for name in chosen:
            if name == "loopback":
                paths[name] = Path(name, workdir)
                continue
            from netbed import NetBed

            bed = NetBed(2, rate=args.rate if name == rate_path else None, tmpfs_size="16m")
            beds.append(bed)
            bed.up()
            if bed.mode != "netns":
                report["skipped_paths"][name] = f"no network namespaces here ({bed.mode_reason})"
                continue
            paths[name] = Path(name, workdir, bed)
        for name in chosen:
            report["skipped_paths"].setdefault(name, "")
        todo = [m for m in methods if m not in unavailable]
        for repeat in range(args.repeats):
            for name, path in paths.items():
                for method in todo:
                    for streams, mode in configs[name]:
                        result = measure(path, method, streams, mode, size, chunk, secrets,
                                         args.timeout)
                        report["runs"].append({"path": name, "method": method, "streams": streams,
                                               "mode": mode, "repeat": repeat, **result})
                        shown = result.get("error") or (
                            f"{result['gbps']:.2f} GB/s, CPU send {result['cpu_send']:.2f} s "
                            f"recv {result['cpu_recv']:.2f} s, others {result['other_cpu']:.2f} s")
                        print(f"[{repeat}] {name:12s} {method:46s} {streams} {mode:9s} {shown}",
                              flush=True)
            if args.crypto_mib:
                for name, package in transports.PRIMITIVES.items():
                    if package and transports._missing(package):
                        continue
                    report["primitive_library"][name] = package or "stdlib"
                    report.setdefault("gil_stall", {}).setdefault(name, []).append(
                        gil_probe(name, secrets))
                    for layout in ((1, 1), (1, 2), (2, 1)):
                        result = measure_crypto(name, layout, args.crypto_mib * MiB, chunk, secrets,
                                                workdir)
                        report["crypto"].setdefault(name, {}).setdefault(
                            f"{layout[0]}x{layout[1]}", []).append(result)
                        print(f"[{repeat}] crypto {name:42s} {layout} "
                              f"{result.get('error') or format(result['gbps'], '.2f') + ' GB/s'}",
                              flush=True)
    finally:
        for bed in beds:
            bed.down()
        shutil.rmtree(workdir, ignore_errors=True)
    report["load_end"] = loadavg()
    report["other_users"] = top_cpu_users(  # not this benchmark's processes
        snapshot, process_cpu(), lambda pid, cmd: pid == os.getpid() or "bench_transport" in cmd)
    ok = [r for r in report["runs"] if "error" not in r]
    report["other_cpu_total"] = sum(r["other_cpu"] for r in ok)
    report["interrupt_cpu_total"] = sum(r["interrupt_cpu"] for r in ok)
    report["steal_total"] = sum(r["steal"] for r in ok)
    report["transfer_seconds_total"] = sum(r["seconds"] for r in ok)
    if interpretation:
        report["interpretation"] = interpretation
    text = render(report, interpretation)
    print(text)
    write_report(args.out, text, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
