"""``TensorAwareStateDict``: the reference's interface between a training state and local
checkpoints, and how ``LocalCheckpointManager`` turns one into a part and back.

- :class:`TensorAwareStateDict` is the abstract interface (separate tensors from the rest,
  move them to the CPU and back), so subclasses written for the reference keep working.
- :class:`NestedTensorAwareStateDict` implements it over a nested ``state_dict`` (dicts,
  lists, tuples); :class:`BasicTensorAwareStateDict` is the one users wrap their state in.
- :func:`part_state_dict` / :func:`restore_from_part`: a nested one is stored as its
  plain values and raw tensors (nothing pickled). Any other subclass is stored as the
  reference stores it: tensors copied to the CPU (``copy_tensors_to_cpu``), then the
  whole object serialized with ``torch.save``; loading it unpickles it (``torch.load(...,
  weights_only=False)``) and calls ``restore_tensor_device``. Load such parts only from
  your own job's local directory: they are checked against their checksums, but
  unpickling runs code.
"""

from __future__ import annotations

import io
from abc import ABC, abstractmethod
from typing import Any, Iterable, Iterator

import torch

#: Top-level key of the state dict a pickled TensorAwareStateDict is stored under.
PICKLED_OBJECT_KEY = "__ckpt_client_pickled_tensor_aware_state_dict__"


class TensorAwareStateDict(ABC):
    """What local checkpointing needs from a training state (the reference's interface).

    Subclasses tell tensors apart from everything else, so that the tensors can be moved
    (to the CPU, into a checkpoint) without touching the rest.
    """

    @abstractmethod
    def pop_tensors(self) -> list[torch.Tensor]:
        """Take the tensors out, leaving placeholders (the state becomes *hollow*)."""

    @property
    @abstractmethod
    def tensors(self) -> Iterable[torch.Tensor]:
        """The tensors, in a fixed order."""

    @property
    @abstractmethod
    def is_hollow(self) -> bool:
        """Whether the tensors were popped and not inserted back."""

    @abstractmethod
    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back in place of the placeholders (the reverse of ``pop_tensors``)."""

    @abstractmethod
    def init_tensors(self) -> None:
        """Replace the placeholders by new uninitialized tensors of the same shape, dtype
        and device."""

    @abstractmethod
    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies, remembering their devices."""

    @abstractmethod
    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to the devices remembered by ``copy_tensors_to_cpu``."""

    def values(self):
        """The object's attribute values (as the reference's base class)."""
        return vars(self).values()


class TensorPlaceholder:
    """Stands in for a popped tensor: its shape, dtype and device.

    Parameters
    ----------
    tensor : torch.Tensor
        The tensor it replaces.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self.device = tensor.device

    def init_tensor(self) -> torch.Tensor:
        """A new uninitialized tensor like the one replaced."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)


def _map_leaves(fn, value: Any, kinds: tuple) -> Any:
    """Apply ``fn`` to every leaf of type ``kinds``; dicts and lists change in place."""
    if isinstance(value, dict):
        for key, item in value.items():
            value[key] = _map_leaves(fn, item, kinds)
        return value
    if isinstance(value, list):
        value[:] = [_map_leaves(fn, item, kinds) for item in value]
        return value
    if isinstance(value, tuple):
        return tuple(_map_leaves(fn, item, kinds) for item in value)
    return fn(value) if isinstance(value, kinds) else value


def _leaves(value: Any, kinds: tuple) -> Iterator:
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item, kinds)
    elif isinstance(value, kinds):
        yield value


class NestedTensorAwareStateDict(TensorAwareStateDict):
    """:class:`TensorAwareStateDict` over ``self.state_dict``: tensors nested in dicts,
    lists and tuples (dicts and lists are changed in place)."""

    state_dict: dict

    @property
    def is_hollow(self) -> bool:
        """Whether the tensors were popped and not inserted back."""
        return getattr(self, "_is_hollow", False)

    def _check_hollow(self, expected: bool) -> None:
        if self.is_hollow != expected:
            state = "hollow (its tensors were popped)" if self.is_hollow else "not hollow"
            raise RuntimeError(f"{type(self).__name__} is {state}")

    @property
    def tensors(self) -> Iterator[torch.Tensor]:
        """The tensors, depth first in insertion order."""
        self._check_hollow(False)
        return _leaves(self.state_dict, (torch.Tensor,))

    def pop_tensors(self) -> list[torch.Tensor]:
        """Take the tensors out, leaving :class:`TensorPlaceholder` in their place."""
        popped = list(self.tensors)
        self.state_dict = _map_leaves(TensorPlaceholder, self.state_dict, (torch.Tensor,))
        self._is_hollow = True
        return popped

    def insert_tensors(self, tensor_data: Iterable[torch.Tensor]) -> None:
        """Put tensors back, in the order ``pop_tensors`` returned them."""
        self._check_hollow(True)
        remaining = iter(tensor_data)
        self.state_dict = _map_leaves(lambda _: next(remaining), self.state_dict,
                                      (TensorPlaceholder,))
        self._is_hollow = False

    def init_tensors(self) -> None:
        """Replace the placeholders by new uninitialized tensors."""
        self._check_hollow(True)
        self.state_dict = _map_leaves(TensorPlaceholder.init_tensor, self.state_dict,
                                      (TensorPlaceholder,))
        self._is_hollow = False

    def copy_tensors_to_cpu(self, non_blocking: bool = False) -> None:
        """Replace the tensors by CPU copies (the originals are not freed here)."""
        self._check_hollow(False)
        self._devices = [t.device for t in self.tensors]
        self.state_dict = _map_leaves(lambda t: t.to("cpu", non_blocking=non_blocking),
                                      self.state_dict, (torch.Tensor,))

    def restore_tensor_device(self, non_blocking: bool = True) -> None:
        """Move the tensors back to where ``copy_tensors_to_cpu`` found them."""
        self._check_hollow(False)
        devices = iter(getattr(self, "_devices", None) or [])
        self.state_dict = _map_leaves(
            lambda t: t.to(next(devices, t.device), non_blocking=non_blocking),
            self.state_dict, (torch.Tensor,))


def part_state_dict(ta_state_dict: Any) -> dict:
    """The nested state dict ``LocalCheckpointManager.save`` stages for ``ta_state_dict``.

    Raises
    ------
    TypeError
        For objects that are neither a :class:`TensorAwareStateDict` nor expose a
        ``state_dict`` dict.
    """
    if isinstance(ta_state_dict, NestedTensorAwareStateDict) or (
            not isinstance(ta_state_dict, TensorAwareStateDict)
            and isinstance(getattr(ta_state_dict, "state_dict", None), dict)):
        return ta_state_dict.state_dict
    if not isinstance(ta_state_dict, TensorAwareStateDict):
        raise TypeError(f"save() takes a TensorAwareStateDict (e.g. BasicTensorAwareStateDict), "
                        f"not {type(ta_state_dict).__name__}")
    ta_state_dict.copy_tensors_to_cpu(non_blocking=False)
    buffer = io.BytesIO()
    torch.save(ta_state_dict, buffer)
    return {PICKLED_OBJECT_KEY: torch.frombuffer(buffer.getbuffer(), dtype=torch.uint8)}


def restore_from_part(state_dict: dict) -> TensorAwareStateDict | None:
    """The object :func:`part_state_dict` serialized, on its devices again; ``None`` for a
    plain nested state dict."""
    if not (isinstance(state_dict, dict) and list(state_dict) == [PICKLED_OBJECT_KEY]):
        return None
    raw = state_dict[PICKLED_OBJECT_KEY].numpy().tobytes()
    restored = torch.load(io.BytesIO(raw), weights_only=False)
    restored.restore_tensor_device(non_blocking=False)
    return restored


class BasicTensorAwareStateDict(NestedTensorAwareStateDict):
    """A state dict whose tensors are reachable through dicts, lists and tuples.

    Parameters
    ----------
    state_dict : dict
        Tensors (CPU or CUDA) and plain values (str, bytes, numbers, bool, None) nested
        in dicts, lists and tuples. Anything else is refused at ``save`` time, since
        parts are stored without pickling.

    Attributes
    ----------
    state_dict : dict
        The wrapped state dict (after ``load``: tensors on the CPU).
    """

    def __init__(self, state_dict: dict) -> None:
        self.state_dict = state_dict

    def __repr__(self) -> str:
        return f"BasicTensorAwareStateDict({len(self.state_dict)} top-level keys)"
