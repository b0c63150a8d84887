"""Run a function on N real trainer processes joined in a real gloo process group.

Each rank is a fresh Python process with ``CKPTD_SOCKET`` pointing at the test's daemon;
results (or the exception, as text) come back through a queue. A rank that neither
returns nor dies within the timeout fails the test; nothing is mocked.

Ranks are forked by a ``forkserver`` that imported torch (and ckpt_client) once: a
``spawn``-ed rank spent 1.5-2 s of CPU importing torch, and the suite starts hundreds of
ranks. The forkserver ran nothing but those imports (it is not the test process), so
each rank still starts with nothing of another rank or test in it; it gets the test
process's environment as it is when the ranks start (the forkserver's own is the one it
started with).
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import traceback
from dataclasses import dataclass


@dataclass
class RankOutcome:
    rank: int
    value: object = None
    error: str | None = None
    exitcode: int | None = None


#: Imported once by the forkserver, before it forks any rank. Every rank function imports
#: ckpt_client (0.7 s of CPU a rank after torch); it reads no knob and starts no thread at
#: import, so a rank forked with it loaded is the rank that would have imported it.
_PRELOAD = ["torch", "torch.distributed", "ckpt_client"]


def _rank_context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _rank_main(fn, rank, world_size, store_path, socket_path, args, results, environ=None):
    if environ is not None:  # the test's environment now, not the forkserver's at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ["CKPTD_SOCKET"] = socket_path
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=world_size)
    try:
        results.put(RankOutcome(rank, value=fn(rank, world_size, *args)))
    except BaseException as exc:  # reported to the test, which decides
        results.put(RankOutcome(rank, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def start_ranks(fn, world_size: int, socket_path, tmp_path, args=(), name="pg",
                daemon: bool = True):
    """Start the ranks; returns (processes, result queue).

    ``socket_path`` is one daemon socket for all ranks, or a list with one per rank
    (several "nodes": e.g. ranks 0-1 on daemon A, ranks 2-3 on daemon B). Ranks that
    start helper processes themselves (hand-built async requests) need ``daemon=False``:
    daemonic processes may not have children.
    """
    sockets = socket_path if isinstance(socket_path, (list, tuple)) else [socket_path] * world_size
    context = _rank_context()
    results = context.Queue()
    store_path = str(tmp_path / f"{name}-store")
    if os.path.exists(store_path):
        os.unlink(store_path)
    processes = [context.Process(target=_rank_main, daemon=daemon,
                                 args=(fn, rank, world_size, store_path, sockets[rank], args, results,
                                       dict(os.environ)))
                 for rank in range(world_size)]
    for p in processes:
        p.start()
    return processes, results


def collect(processes, results, timeout: float = 240.0) -> list[RankOutcome]:
    """Wait for every rank's outcome (a rank that died without one gets its exit code)."""
    import time

    outcomes: dict[int, RankOutcome] = {}
    deadline = time.monotonic() + timeout
    while len(outcomes) < len(processes):
        try:
            outcome = results.get(timeout=0.2)
            outcomes[outcome.rank] = outcome
            continue
        except queue.Empty:
            pass
        for rank, p in enumerate(processes):
            if rank not in outcomes and not p.is_alive() and p.exitcode is not None:
                # give a last chance for an outcome already in the pipe
                try:
                    outcome = results.get(timeout=1.0)
                    outcomes[outcome.rank] = outcome
                except queue.Empty:
                    outcomes[rank] = RankOutcome(rank, error=f"rank died with exit code {p.exitcode}",
                                                 exitcode=p.exitcode)
        if time.monotonic() > deadline:
            for p in processes:
                p.kill()
            raise AssertionError(f"ranks {sorted(set(range(len(processes))) - set(outcomes))} "
                                 f"gave no result within {timeout:.0f}s")
    for p in processes:
        p.join(timeout=30)
    return [outcomes[r] for r in range(len(processes))]


def run_ranks(fn, world_size: int, socket_path, tmp_path, args=(), timeout=240.0,
              name="pg", daemon: bool = True) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on every rank and return the outcomes."""
    processes, results = start_ranks(fn, world_size, socket_path, tmp_path, args, name, daemon)
    return collect(processes, results, timeout)


def values(outcomes: list[RankOutcome]) -> list:
    """The ranks' return values, failing with every rank's error if any raised."""
    errors = [f"rank {o.rank}: {o.error}" for o in outcomes if o.error]
    assert not errors, "\n".join(errors)
    return [o.value for o in outcomes]
