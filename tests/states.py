"""Comparing a loaded state dict with the one that was saved, leaf by leaf."""

import torch


def assert_same(loaded, expected) -> None:
    """Equal structure, equal tensors (dtype included) and equal plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype
        assert torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert set(loaded) == set(expected)
        for key in expected:
            assert_same(loaded[key], expected[key])
    else:
        assert loaded == expected
