"""Extent layout: the offsets both sides compute without sending them."""

import pytest

from ckptd import protocol


def test_layout_aligns_every_buffer_and_the_extent():
    offsets, total = protocol.layout_extent([10, 100, 0, 5])
    assert all(o % protocol.TENSOR_ALIGNMENT == 0 for o in offsets)
    assert offsets == sorted(offsets) and offsets[1] >= 10 and offsets[3] >= offsets[1] + 100
    assert total % protocol.EXTENT_ALIGNMENT == 0 and total >= offsets[-1] + 5


def test_an_empty_save_still_gets_one_page():
    assert protocol.layout_extent([]) == ([], protocol.EXTENT_ALIGNMENT)


@pytest.mark.parametrize("value, alignment, expected", [(0, 64, 0), (1, 64, 64), (64, 64, 64),
                                                        (65, 64, 128), (4097, 4096, 8192)])
def test_align_up(value, alignment, expected):
    assert protocol.align_up(value, alignment) == expected


def test_large_tensors_start_on_a_page_of_the_extent_small_ones_pack_tightly():
    large = protocol.PAGE_ALIGNED_FROM
    sizes = [10, large, 3, large + 1, 64, 0, 2 * large]
    offsets, total = protocol.layout_extent(sizes)
    for size, offset in zip(sizes, offsets):
        assert offset % (protocol.PAGE_ALIGNMENT if size >= large else protocol.TENSOR_ALIGNMENT) == 0
    assert offsets[2] < offsets[1] + large + protocol.TENSOR_ALIGNMENT  # no page for 3 bytes
    assert all(b >= a + n for a, b, n in zip(offsets, offsets[1:], sizes))
    assert total >= offsets[-1] + sizes[-1]


def test_the_written_out_layout_matches_align_up_and_tensor_alignment_buffer_by_buffer():
    """layout_extent inlines the arithmetic for speed; both ends must still agree with
    the rule as the helpers state it, on sizes around every alignment boundary."""
    import random

    rng = random.Random(7)
    large = protocol.PAGE_ALIGNED_FROM
    sizes = [0, 1, 63, 64, 65, large - 1, large, large + 1, 4095, 4096, 4097]
    sizes += [rng.randrange(0, 3 * large) for _ in range(500)]
    rng.shuffle(sizes)
    offsets, cursor = [], 0
    for size in sizes:
        cursor = protocol.align_up(cursor, protocol.tensor_alignment(size))
        offsets.append(cursor)
        cursor = protocol.align_up(cursor + size, protocol.TENSOR_ALIGNMENT)
    expected = (offsets, protocol.align_up(max(cursor, 1), protocol.EXTENT_ALIGNMENT))
    assert protocol.layout_extent(sizes) == expected
