"""Which non-tensor leaves of a DCP save may take the ``torch.save`` bytes of an earlier one.

A training state's small leaves (steps, learning rates, betas, id lists) are pickled
with ``torch.save`` into byte items on every save, at some 25 µs each; most of them
repeat from save to save. This module owns the rule for handing the earlier bytes out
again: the value must be the very same value, not only an equal one (``0.0 == -0.0``
and ``1 == True``, but they pickle apart), and ``torch.save``'s settings the same. Pure
functions; the bytes themselves are kept by their users.
"""

from __future__ import annotations

from typing import Any

import torch

_EXACT_SCALARS = frozenset({int, bool, type(None)})
_NUMBERS = frozenset({int, bool, float, type(None)})
#: The longest list or tuple of numbers given a key: the key is built on every save, hit or
#: miss, and for a long list it costs more than the ``torch.save`` it would spare (4,096
#: floats: 3.4 ms for the key against 2.3 ms to pickle); the leaves worth it are short
#: (betas, a few counters).
MAX_KEYED_ENTRIES = 64
#: The longest list or tuple of plain ints given a key nonetheless: its key is the same
#: ints as a tuple, made at C speed (an optimizer param group's 230 ids: 10 µs against
#: 0.26 ms to pickle). Longer lists would pickle past :data:`MAX_KEPT_BYTES`, unkept.
MAX_KEYED_INTS = 8192
_INTS = {int}
#: The largest ``torch.save`` bytes kept for the next save: kept bytes (and the key, which
#: holds the value) live until then, and a large leaf costs little to pickle per byte.
MAX_KEPT_BYTES = 64 * 1024


def worth_keeping(size: int) -> bool:
    """Whether a leaf's ``torch.save`` bytes, ``size`` long, are kept for the next save."""
    return size <= MAX_KEPT_BYTES


def exact_key(value: Any) -> tuple | None:
    """A key equal only for values ``torch.save`` writes alike (``None``: do not keep).

    Floats go by their exact bits; a short list or tuple only of numbers qualifies
    (strings in one could be one object twice, which pickles differently from two equal
    ones), and a longer one only of plain ints (id lists); a long string or bytes does not
    (the key would keep it alive).
    """
    kind = type(value)
    if kind in _EXACT_SCALARS or ((kind is str or kind is bytes)
                                  and len(value) <= MAX_KEPT_BYTES):
        return (kind, value)
    if kind is float:
        return (float, value.hex()) if value == value else None
    if (kind is list or kind is tuple) and len(value) <= MAX_KEYED_ENTRIES:
        for entry in value:
            if type(entry) not in _NUMBERS or entry != entry:
                return None
        return (kind, tuple((type(e), e.hex() if type(e) is float else e) for e in value))
    # Ints pickle by value alone (no memo, and bools are not ints here): equal tuples of
    # them pickle alike. The key has three entries, so it never equals a short list's.
    if (kind is list or kind is tuple) and len(value) <= MAX_KEYED_INTS \
            and set(map(type, value)) == _INTS:
        return (kind, int, tuple(value))
    return None


def save_settings() -> tuple:
    """What ``torch.save``'s bytes depend on besides the value."""
    from torch.utils.serialization import config

    return (torch.save, config.save.compute_crc32, config.save.storage_alignment,
            config.save.use_pinned_memory_for_d2h)
