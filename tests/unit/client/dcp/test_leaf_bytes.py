"""Keys of non-tensor leaves whose earlier ``torch.save`` bytes a DCP save may reuse:
long lists of plain ints (an optimizer param group's ids) get one, and the key tells
apart every two values that pickle apart."""

from __future__ import annotations

import io

import torch

from ckpt_client.dcp.leaf_bytes import MAX_KEYED_ENTRIES, MAX_KEYED_INTS, exact_key


def pickled(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def test_a_long_list_of_plain_ints_is_keyed_by_its_ints():
    ids = list(range(230))
    assert exact_key(ids) == exact_key(list(ids)) is not None
    assert exact_key(ids) != exact_key(tuple(ids))  # a list and a tuple pickle apart
    assert exact_key(ids) != exact_key(ids[:-1] + [230])
    assert exact_key(list(range(MAX_KEYED_INTS))) is not None
    assert exact_key(list(range(MAX_KEYED_INTS + 1))) is None


def test_values_that_pickle_apart_never_share_a_key():
    """Every pair of these values with equal keys pickles to the same bytes: bools are
    not ints, a short list's key never equals a long one's, and a list with a float
    among its ints is not keyed as ints."""
    long = list(range(MAX_KEYED_ENTRIES + 5))
    values = [long, long[:-1] + [True], long[:-1] + [1.0], tuple(long), list(range(3)),
              [0, 1, 2], (0, 1, 2), [0, 1, True]]
    for a in values:
        for b in values:
            key_a, key_b = exact_key(a), exact_key(b)
            if key_a is not None and key_a == key_b:
                assert pickled(a) == pickled(b), (a, b)
    assert exact_key(long[:-1] + [True]) is None and exact_key(long[:-1] + [1.0]) is None
