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
