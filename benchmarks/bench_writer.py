"""Where a ckptd writer's time goes: one torch-format file written from shared memory.

Writes the same pool-resident state dict as one torch-format file in several ways, next to
a raw write + fsync of the same bytes:

- A: ``torch.save`` through ``ckptd.checksum.ChecksumWriter`` into an unbuffered file
  (torch's zip CRC32 + ckptd's zlib CRC32, fsync at the end), as writers did at first;
- B: A with torch's own zip CRC32 off (``torch.utils.serialization.config.save.compute_crc32``);
- C: B plus ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` every 64 MiB (writeback overlaps);
- D: C without ckptd's zlib CRC32 (what a much faster checksum would approach);
- E: the writer before issue 11: ``torch.save`` (CRC off) of tensors viewing the pool,
  through ``write_file_atomically`` (``DurableFileStream``: CRC beside the write, early
  writeback, fsync, checksum record, rename);
- F: the writer now: ``ckptd.storage.torch_format.write_torch_file`` from pool memoryviews
  (no torch), through the same ``write_file_atomically``, in 64 MiB writes;
- G: F with the zip records' CRC32 computed (stock files, ``FileSystemWriterAsync``).

``--serialize-only`` adds E and F into a stream that discards the bytes (CPU cost of the
format alone); ``--small N`` adds N small tensors (1-16 KiB, an optimizer-like tail) to
show the per-tensor cost. Usage::

    python benchmarks/bench_writer.py --size-gib 1 --repeats 3 --variants E,F
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.utils.serialization import config as ser_config  # noqa: E402

import methods as m  # noqa: E402
import workload  # noqa: E402
from bench_save import drop_caches  # noqa: E402
from procmem import loadavg  # noqa: E402
from ckptd import protocol  # noqa: E402
from ckptd.checksum import ChecksumWriter  # noqa: E402
from ckptd.storage.durable import write_file_atomically  # noqa: E402
from ckptd.storage.torch_format import raw_tensor, write_torch_file  # noqa: E402

SYNC_FILE_RANGE_WRITE = 2
_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                                  ctypes.c_uint]


class EagerWriteback(ChecksumWriter):
    """A ChecksumWriter that starts writeback every ``every`` bytes (crc optional)."""

    def __init__(self, target, fd: int, crc: bool, every: int = 64 << 20) -> None:
        super().__init__(target)
        self.fd, self.docrc, self.every, self.started = fd, crc, every, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.docrc:
            self.crc = zlib.crc32(view, self.crc)
        done = 0
        while done < view.nbytes:
            done += self._target.write(view[done:])
        self.size += done
        if self.size - self.started >= self.every:
            _libc.sync_file_range(self.fd, self.started, self.size - self.started,
                                  SYNC_FILE_RANGE_WRITE)
            self.started = self.size
        return done


def pool_state_dict(state: dict, copy: m.PreallocatedCopy) -> dict:
    """The state dict as a writer sees it: tensors viewing the shared buffer."""
    assert copy._map is not None
    views = iter(torch.frombuffer(copy._map, dtype=torch.uint8, count=t.nbytes, offset=o)
                 .view(t.dtype).view(t.shape)
                 for o, t in zip(copy.offsets, workload.tensors_of(state)))
    return {"model": {k: next(views) for k in state["model"]},
            "buffers": {k: next(views) for k in state["buffers"]}, "meta": state["meta"]}


def write_variant(state: dict, path: str, torch_crc: bool, kind: str) -> tuple[float, float]:
    """(total seconds, seconds before fsync) to write ``state`` as one torch file."""
    ser_config.save.compute_crc32 = torch_crc
    drop_caches()
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as raw:
        stream = (ChecksumWriter(raw) if kind == "plain"
                  else EagerWriteback(raw, raw.fileno(), crc=(kind == "eager")))
        torch.save(state, stream)
        t1 = time.perf_counter()
        os.fsync(raw.fileno())
    t2 = time.perf_counter()
    os.unlink(path)
    ser_config.save.compute_crc32 = True
    return t2 - t0, t1 - t0


def pool_skeleton(state: dict, copy: m.PreallocatedCopy) -> tuple[dict, list]:
    """The state dict as a writer gets it now: a skeleton and raw views of the pool."""
    assert copy._map is not None
    pool = memoryview(copy._map)
    tensors = [raw_tensor(pool[o:o + t.nbytes], str(t.dtype).removeprefix("torch."),
                          list(t.shape))
               for o, t in zip(copy.offsets, workload.tensors_of(state))]
    refs = iter(protocol.TensorRef(i) for i in range(len(tensors)))
    skeleton = {"model": {k: next(refs) for k in state["model"]},
                "buffers": {k: next(refs) for k in state["buffers"]}, "meta": state["meta"]}
    return protocol.unpack_value(protocol.pack_value(skeleton)), tensors


def write_as_writer(path: str, write_body) -> tuple[float, None]:
    """(total seconds, None) of one ``write_file_atomically`` as a writer process runs it."""
    drop_caches()
    t0 = time.perf_counter()
    write_file_atomically(path, write_body)
    elapsed = time.perf_counter() - t0
    for name in (path, path + ".ckptd-sum"):
        os.unlink(name)
    return elapsed, None


class Discard:
    """A stream that drops what it is given (the format's CPU cost alone)."""

    def write(self, data) -> int:
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass


def serialize_only(write_body) -> tuple[float, None]:
    t0 = time.perf_counter()
    write_body(Discard())
    return time.perf_counter() - t0, None


VARIANTS = {
    "A": ("A ckptd at first: torch zip CRC32 + zlib CRC32, fsync at end", True, "plain"),
    "B": ("B torch compute_crc32=False", False, "plain"),
    "C": ("C B + sync_file_range every 64 MiB", False, "eager"),
    "D": ("D C without ckptd's zlib CRC32", False, "eager-nocrc"),
}
WRITER_VARIANTS = {
    "E": "E writer before: torch.save (CRC off) -> write_file_atomically",
    "F": "F writer now: torch_format (no torch) -> write_file_atomically",
    "G": "G F with zip CRC32 (stock files)",
}


def torch_save_body(pooled: dict):
    def body(stream) -> None:
        ser_config.save.compute_crc32 = False
        try:
            torch.save(pooled, stream)
        finally:
            ser_config.save.compute_crc32 = True
    return body


def torch_format_body(skeleton, tensors, crc32: bool = False):
    return lambda stream: write_torch_file(stream, skeleton, tensors, crc32=crc32,
                                           max_write=64 << 20)


def add_small_tensors(state: dict, count: int) -> None:
    """``count`` small fp32 tensors (1-16 KiB), like an optimizer's per-parameter tail."""
    generator = torch.Generator().manual_seed(1)
    for i in range(count):
        numel = 1 << (8 + i % 5)  # 256..4096 elements: 1..16 KiB
        state["buffers"][f"optimizer.state.{i}.exp_avg"] = torch.rand(numel, generator=generator)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    p.add_argument("--variants", default="A,B,C,D,E,F,G",
                   help="which of A-G to run (comma-separated)")
    p.add_argument("--serialize-only", action="store_true",
                   help="also time E and F into a stream that discards the bytes")
    p.add_argument("--small", type=int, default=0, help="extra small tensors (1-16 KiB)")
    args = p.parse_args(argv)
    chosen = [v.strip().upper() for v in args.variants.split(",") if v.strip()]
    state, mix = workload.build_state_dict(int(args.size_gib * (1 << 30)))
    if args.small:
        add_small_tensors(state, args.small)
        tensors = workload.tensors_of(state)
        mix = workload.Mix(sum(t.nbytes for t in tensors), len(tensors), mix.large,
                           mix.medium, mix.small + args.small, mix.by_dtype)
    copy = m.PreallocatedCopy(workload.tensors_of(state))
    copy.prepare()
    copy.start("")
    pooled = pool_state_dict(state, copy)
    skeleton, raw_tensors = pool_skeleton(state, copy)
    raw = m.RawWrite(copy)
    outdir = tempfile.mkdtemp(prefix="ckpt-writer-bench-", dir=args.workdir)
    rows: dict = {}
    load_start = loadavg()
    try:
        for _ in range(args.repeats):  # interleaved, so load drift hits every variant alike
            drop_caches()
            t0 = time.perf_counter()
            raw.start(os.path.join(outdir, "raw"))
            rows.setdefault("raw write + fsync (32 MiB writes)", []).append(
                (time.perf_counter() - t0, None))
            m.remove_tree(os.path.join(outdir, "raw"))
            for key in chosen:
                if key in VARIANTS:
                    name, torch_crc, kind = VARIANTS[key]
                    rows.setdefault(name, []).append(
                        write_variant(pooled, os.path.join(outdir, "v.pt"), torch_crc, kind))
                else:
                    body = (torch_save_body(pooled) if key == "E"
                            else torch_format_body(skeleton, raw_tensors, crc32=key == "G"))
                    rows.setdefault(WRITER_VARIANTS[key], []).append(
                        write_as_writer(os.path.join(outdir, "w.pt"), body))
                    if args.serialize_only:
                        rows.setdefault(f"{key} serialization only (bytes discarded)",
                                        []).append(serialize_only(body))
        crc_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            zlib.crc32(copy.raw_bytes())
            crc_s.append(time.perf_counter() - t0)
    finally:
        del raw_tensors  # views of the pool: released before it is unmapped
        copy.close()
        m.remove_tree(outdir)
    print(f"{mix.total_bytes / (1 << 30):.3f} GiB, {mix.tensors} tensors; load {load_start} -> "
          f"{loadavg()}; medians of {args.repeats}")
    print("| variant | total s | before fsync s | GB/s | runs |\n|---|---|---|---|---|")
    for name, runs in rows.items():
        total = statistics.median(r[0] for r in runs)
        before = [r[1] for r in runs if r[1] is not None]
        print(f"| {name} | {total:.3f} | "
              f"{statistics.median(before):.3f} | " if before else f"| {name} | {total:.3f} | – | ",
              end="")
        print(f"{mix.total_bytes / total / 1e9:.2f} | {[round(r[0], 2) for r in runs]} |")
    print(f"| zlib.crc32 alone over the bytes | {statistics.median(crc_s):.3f} | – | "
          f"{mix.total_bytes / statistics.median(crc_s) / 1e9:.2f} | "
          f"{[round(x, 2) for x in crc_s]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
