"""``PoolCopier``: the trainer's share of staging lands at the right bytes of the pool."""

from __future__ import annotations

import io
import os

import torch

from ckptd import protocol
from ckpt_client.transport.flatten import describe
from ckpt_client.transport.pool_copy import PoolCopier


def sources_of(step: int) -> list:
    return [torch.arange(6, dtype=torch.float32).reshape(2, 3) + step,
            torch.arange(5, dtype=torch.int64).t() * step,
            torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
            bytes([step]) * 7,
            io.BytesIO(bytes([step, step + 1]) * 2),
            torch.empty(0, dtype=torch.bfloat16)]


def raw(source) -> bytes:
    if isinstance(source, torch.Tensor):
        return source.contiguous().view(torch.uint8).numpy().tobytes()
    return bytes(source.getbuffer() if isinstance(source, io.BytesIO) else source)


def layout(sources: list) -> tuple[list, list, int]:
    buffers = [describe(s) for s in sources]
    offsets, total = protocol.layout_extent([b[2] for b in buffers])
    return buffers, offsets, total


def staged(pool: torch.Tensor, base: int, offsets: list, buffers: list, index: int) -> bytes:
    start = base + offsets[index]
    return pool[start:start + buffers[index][2]].numpy().tobytes()


def test_every_chosen_buffer_lands_at_its_offset_and_nothing_else_is_written():
    sources = sources_of(1)
    buffers, offsets, total = layout(sources)
    pool = torch.zeros(2 * total + 4096, dtype=torch.uint8)
    PoolCopier(pool).copy(4096, offsets, buffers, sources, [0, 2, 3, 4, 5])
    for index in (0, 2, 3, 4):
        assert staged(pool, 4096, offsets, buffers, index) == raw(sources[index]), index
    assert staged(pool, 4096, offsets, buffers, 1) == bytes(buffers[1][2]), "not chosen"
    assert not pool[:4096].any(), "bytes before the extent were written"


def test_a_repeated_layout_reuses_its_views_with_the_new_values_and_a_new_place_gets_its_own():
    first, second = sources_of(1), sources_of(2)
    buffers, offsets, total = layout(first)
    pool = torch.zeros(3 * total, dtype=torch.uint8)
    copier = PoolCopier(pool)
    everything = list(range(len(first)))
    copier.copy(0, offsets, buffers, first, everything)
    copier.copy(0, offsets, buffers, second, everything)
    for index in range(len(second)):
        assert staged(pool, 0, offsets, buffers, index) == raw(second[index]), index
    copier.copy(total, offsets, buffers, first, everything)  # same layout, another extent
    for index in range(len(first)):
        assert staged(pool, total, offsets, buffers, index) == raw(first[index]), index
    assert staged(pool, 0, offsets, buffers, 1) == raw(second[1]), "the first extent changed"


def test_a_changed_layout_is_not_served_stale_views():
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    copier = PoolCopier(pool)
    small = [torch.ones(4, dtype=torch.float32)]
    large = [torch.full((8,), 2.0, dtype=torch.float64)]
    for sources in (small, large, small):
        buffers, offsets, _ = layout(sources)
        copier.copy(0, offsets, buffers, sources, [0])
        assert staged(pool, 0, offsets, buffers, 0) == raw(sources[0])


def test_the_very_layout_list_of_the_last_save_skips_the_key_but_not_a_change_of_place():
    """A save sent ahead hands the copier the very list of the save before: the views of
    that copy are reused without a key over every buffer, only for the same place and the
    same chosen buffers; an equal list that is another object, another base or another
    choice still lands every byte where it belongs."""
    tensors = [torch.arange(8, dtype=torch.float32) + k for k in range(3)]
    buffers, offsets, total = layout(tensors)
    pool = torch.zeros(3 * total, dtype=torch.uint8)
    copier = PoolCopier(pool)
    every = [0, 1, 2]
    copier.copy(0, offsets, buffers, tensors, every)
    again = [t * 10 for t in tensors]
    copier.copy(0, offsets, buffers, again, every)
    assert all(staged(pool, 0, offsets, buffers, i) == raw(again[i]) for i in every)
    copier.copy(total, offsets, buffers, tensors, every)  # same list, another place
    assert all(staged(pool, total, offsets, buffers, i) == raw(tensors[i]) for i in every)
    equal = [list(b) for b in buffers]
    third = [t + 100 for t in tensors]
    copier.copy(total, offsets, equal, third, [1])  # another list object, one buffer
    assert staged(pool, total, offsets, buffers, 1) == raw(third[1])
    assert staged(pool, total, offsets, buffers, 0) == raw(tensors[0])


class Reports:
    """What :class:`~ckpt_client.transport.copy_reports.CopyReports` is to the copier: a
    step, and a call per report (here it checks the bytes said copied are in the pool)."""

    def __init__(self, step: int, pool, base, offsets, buffers, sources) -> None:
        self.step, self.told = step, []
        self._check = (pool, base, offsets, buffers, sources)

    def __call__(self, through: int) -> None:
        pool, base, offsets, buffers, sources = self._check
        for index, offset in enumerate(offsets):  # every buffer below it is whole already
            if offset + buffers[index][2] <= through:
                assert staged(pool, base, offsets, buffers, index) == raw(sources[index])
        self.told.append(through)


def test_a_copy_with_reports_goes_in_steps_in_extent_order_and_says_where_each_ends():
    for with_bytes in (False, True):  # the one-call path, and the path with byte items
        sources = [torch.full((n,), float(n)) for n in (3000, 10, 5000, 700, 4000, 1)]
        if with_bytes:
            sources[3] = bytes(range(200)) * 14
        buffers, offsets, total = layout(sources)
        pool = torch.zeros(total + 4096, dtype=torch.uint8)
        reports = Reports(16384, pool, 128, offsets, buffers, sources)
        PoolCopier(pool).copy(128, offsets, buffers, sources, list(range(len(sources))),
                              reports=reports)
        ends = [offsets[i] + buffers[i][2] for i in range(len(sources))]
        assert reports.told, "a copy of several steps reports"
        assert reports.told == sorted(reports.told) and set(reports.told) <= set(ends)
        assert all(b - a >= 16384 for a, b in zip([0, *reports.told], reports.told))
        assert reports.told[-1] < ends[-1]  # the end is STAGED's to say
        for index, source in enumerate(sources):
            assert staged(pool, 128, offsets, buffers, index) == raw(source)


def test_which_copies_report_follows_the_knob_and_the_cpus_at_hand():
    from ckptd import knobs
    from ckpt_client.transport.copy_reports import copy_reports

    cpus = len(os.sched_getaffinity(0))

    def made(which: str, background: bool, total: int = 256 << 20, min_cpus: int = 4) -> bool:
        with knobs.override(COPY_REPORTS=which, COPY_REPORT_BYTES=64 << 20,
                            COPY_REPORTS_MIN_CPUS=min_cpus):
            return copy_reports(None, 1, None, total, background) is not None

    assert made("background", True) and not made("background", False)
    assert made("always", False) and not made("off", True)
    assert not made("always", True, total=127 << 20)  # under two steps: nothing to overlap
    assert not made("auto", True, min_cpus=cpus + 1)  # fewer CPUs than it wants: the step keeps them
    assert made("auto", True, min_cpus=cpus) and not made("auto", False, min_cpus=cpus)
