"""Where a ckptd writer's time goes: one torch-format file written from shared memory.

Reproduces what a ckptd writer process does for ``TorchAsyncCheckpoint`` (``torch.save``
of tensors that view the staging pool, through ``ckptd.checksum.ChecksumWriter`` into an
unbuffered file, fsync at the end) and variants that each remove one cost, next to a raw
write + fsync of the same bytes:

- A: as ckptd does it today (torch's zip CRC32 + ckptd's zlib CRC32, fsync at the end);
- B: A with torch's own zip CRC32 off (``torch.utils.serialization.config.save.compute_crc32``);
- C: B plus ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` every 64 MiB (writeback overlaps);
- D: C without ckptd's zlib CRC32 (what a much faster checksum would approach).

It measures serialization costs only; nothing here changes ckptd. Usage::

    python benchmarks/bench_writer.py --size-gib 1 --repeats 3
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
from bench_save import drop_caches, loadavg  # noqa: E402
from ckptd.checksum import ChecksumWriter  # noqa: E402

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


VARIANTS = [
    ("A ckptd today: torch zip CRC32 + zlib CRC32, fsync at end", True, "plain"),
    ("B torch compute_crc32=False", False, "plain"),
    ("C B + sync_file_range every 64 MiB", False, "eager"),
    ("D C without ckptd's zlib CRC32", False, "eager-nocrc"),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workdir", default=tempfile.gettempdir())
    args = p.parse_args(argv)
    state, mix = workload.build_state_dict(int(args.size_gib * (1 << 30)))
    copy = m.PreallocatedCopy(workload.tensors_of(state))
    copy.prepare()
    copy.start("")
    pooled = pool_state_dict(state, copy)
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
            for name, torch_crc, kind in VARIANTS:
                rows.setdefault(name, []).append(
                    write_variant(pooled, os.path.join(outdir, "v.pt"), torch_crc, kind))
        crc_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            zlib.crc32(copy.raw_bytes())
            crc_s.append(time.perf_counter() - t0)
    finally:
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
