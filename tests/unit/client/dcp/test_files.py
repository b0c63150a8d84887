"""Which DCP items go into which file, and which files into which request."""

from __future__ import annotations

import io
import random

import pytest
import torch

from ckptd import protocol
from ckpt_client.dcp.files import chunk_files, item_nbytes, split_into_files


def test_items_are_spread_over_files_of_balanced_size_each_item_once():
    sizes = [100, 1, 50, 50, 30, 20, 99]
    files = split_into_files(sizes, 3)
    assert sorted(i for f in files for i in f) == list(range(len(sizes)))
    assert all(f == sorted(f) for f in files)
    totals = sorted(sum(sizes[i] for i in f) for f in files)
    assert totals[-1] - totals[0] <= max(sizes), totals


@pytest.mark.parametrize("count,expected", [(0, 1), (1, 1), (3, 3), (10, 4)])
def test_there_are_never_more_files_than_items_nor_fewer_than_one(count, expected):
    assert len(split_into_files([5, 5, 5, 5], count)) == expected


def test_no_items_make_no_files():
    assert split_into_files([], 4) == []


def test_greedy_balance_on_random_sizes():
    rng = random.Random(7)
    for _ in range(50):
        sizes = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))]
        count = rng.randrange(1, 8)
        totals = [sum(sizes[i] for i in f) for f in split_into_files(sizes, count)]
        assert max(totals) - min(totals) <= max(sizes)


def sources(*nbytes: int) -> list:
    return [torch.empty(n, dtype=torch.uint8) if n % 2 else io.BytesIO(bytes(n)) for n in nbytes]


def extent(sources_: list, chunk: list) -> int:
    return protocol.layout_extent([item_nbytes(sources_[i]) for f in chunk for i in f])[1]


def test_everything_in_one_request_when_it_fits_the_pool():
    items = sources(1000, 3000, 2001, 10)
    chunks = chunk_files(items, 2, pool_size=1 << 20)
    assert len(chunks) == 1 and len(chunks[0]) == 2
    assert sorted(i for f in chunks[0] for i in f) == [0, 1, 2, 3]


def test_more_than_the_pool_is_cut_into_requests_that_each_fit():
    pool = 64 << 10
    items = sources(*([10_001] * 20))  # about 3x the pool
    chunks = chunk_files(items, 2, pool_size=pool)
    assert len(chunks) > 1
    assert sorted(i for c in chunks for f in c for i in f) == list(range(20))
    assert all(extent(items, c) <= pool for c in chunks), [extent(items, c) for c in chunks]


def test_nothing_to_save_is_one_empty_request():
    assert chunk_files([], 4, pool_size=4096) == [[]]


def test_a_single_item_larger_than_the_pool_stays_one_request_for_the_daemon_to_refuse():
    chunks = chunk_files(sources(9000, 11), 1, pool_size=8192)
    big = [c for c in chunks if any(0 in f for f in c)]
    assert len(big) == 1 and extent(sources(9000, 11), big[0]) > 8192
