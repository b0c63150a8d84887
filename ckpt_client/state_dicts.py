"""Helpers over nested state dicts that the reference's ``checkpointing.utils`` offers.

``diff`` compares two state dicts (tests of save/load round trips use it),
``preload_tensors`` makes host copies of a state dict's tensors, and ``wrap_for_async``
runs a save function with the garbage collector off (what a forked helper needs, so it
does not free CUDA tensors it inherited).
"""

from __future__ import annotations

from typing import Any

import torch

from ckpt_client.queue.gcpause import collector_paused


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Compare two nested state dicts (dicts, lists, tuples, tensors, plain values).

    Parameters
    ----------
    x1, x2
        The two sides.
    prefix : tuple
        Path of ``x1`` / ``x2`` inside larger structures (used in the results).

    Returns
    -------
    (only_left, only_right, mismatch)
        Paths (tuples of keys and indices) present only in ``x1``, only in ``x2``, and
        ``(path, type of x1's value, type of x2's value)`` for values that differ
        (tensors: by shape, dtype or any element, wherever they live).
    """
    only_left: list = []
    only_right: list = []
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1 if k not in x2]
        only_right = [prefix + (k,) for k in x2 if k not in x1]
        for key in (k for k in x1 if k in x2):
            _extend(diff(x1[key], x2[key], prefix + (key,)), only_left, only_right, mismatch)
    elif isinstance(x1, (list, tuple)) and isinstance(x2, (list, tuple)):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (left, right) in enumerate(zip(x1, x2)):
            _extend(diff(left, right, prefix + (i,)), only_left, only_right, mismatch)
    elif not _equal(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def _extend(parts: tuple, *into: list) -> None:
    for part, target in zip(parts, into):
        target.extend(part)


def _equal(x1: Any, x2: Any) -> bool:
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        if not (isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)):
            return False
        return (x1.shape == x2.shape and x1.dtype == x2.dtype
                and bool(torch.equal(x1.cpu(), x2.cpu())))
    try:
        return bool(x1 == x2)
    except (RuntimeError, ValueError):  # objects whose == is not a plain truth value
        return False


def preload_tensors(state_dict: Any, non_blocking: bool = True) -> Any:
    """A copy of ``state_dict`` (dicts and lists rebuilt) with every tensor on the CPU.

    CUDA tensors are copied to host memory (``non_blocking``: the caller synchronizes);
    CPU tensors are the same objects, detached.
    """
    if isinstance(state_dict, dict):
        return {k: preload_tensors(v, non_blocking) for k, v in state_dict.items()}
    if isinstance(state_dict, list):
        return [preload_tensors(v, non_blocking) for v in state_dict]
    if isinstance(state_dict, torch.Tensor):
        return state_dict.detach().to("cpu", non_blocking=non_blocking)
    return state_dict


#: The reference's name for running a function with the cyclic collector paused (what a
#: forked helper needs, so that it does not free CUDA tensors it inherited).
wrap_for_async = collector_paused
