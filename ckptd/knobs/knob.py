"""What a knob is: a default, an environment override, a parser, and the in-process
overrides tests use. The knobs themselves are defined in :mod:`ckptd.knobs` (one place for
every tunable); this module only holds the machinery they share, so that module stays a
plain list of definitions.

Importable without torch or zmq, like the rest of :mod:`ckptd.knobs`.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["Knob", "define", "override", "all_knobs", "markdown_table", "parse_bool",
           "parse_choice", "parse_size"]

def parse_bool(text: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (case-insensitive)."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use 1/0, true/false, yes/no)")


def parse_choice(text: str, choices: tuple) -> str:
    """``text`` if it is one of ``choices`` (case-insensitive), else a ValueError naming them."""
    lowered = text.strip().lower()
    if lowered not in choices:
        raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
    return lowered


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str | int) -> int:
    """Parse ``512M``, ``2G``, ``1.5GiB`` or a plain byte count.

    Raises
    ------
    ValueError
        If ``text`` is not a size.
    """
    if isinstance(text, int):
        return text
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = cleaned[-1] if cleaned and cleaned[-1] in _SIZE_UNITS else ""
    number = cleaned[:-1] if unit else cleaned
    try:
        size = int(float(number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"{text!r} is not a size (try 512M or 4G)") from None
    if size < 0:
        raise ValueError(f"{text!r} is negative")
    return size


_overrides: dict[str, Any] = {}
_registry: dict[str, "Knob"] = {}


@dataclass(frozen=True)
class Knob:
    """One tunable: a default, an optional environment variable, and how to parse it.

    Parameters
    ----------
    name : str
        Python-side name (also the key for :func:`override`).
    default : object
        Value when neither an override nor the environment says otherwise.
    env : str or None
        Environment variable that overrides the default.
    parse : callable
        Turns the environment's text into a value.
    doc : str
        What the knob changes, for ``docs/`` and error messages.
    """

    name: str
    default: Any
    env: str | None
    parse: Callable[[str], Any]
    doc: str

    def get(self) -> Any:
        """The current value: an :func:`override`, else the environment, else the default.

        Raises
        ------
        ValueError
            If the environment variable is set to something that does not parse; the
            message names the variable.
        """
        if self.name in _overrides:
            return _overrides[self.name]
        raw = os.environ.get(self.env) if self.env else None
        if raw is None or raw == "":
            return self.default
        try:
            return self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"environment variable {self.env}={raw!r} is invalid: {exc}; "
                             f"unset it to use the default {self.default!r}") from None


def define(name: str, default: Any, parse: Callable[[str], Any], doc: str,
           env: str | None = "") -> Knob:
    """Make and register the knob ``name`` (its variable ``CKPTD_<name>`` unless ``env``
    names another, or ``None`` for none)."""
    knob = Knob(name, default, f"CKPTD_{name}" if env == "" else env, parse, doc)
    _registry[name] = knob
    return knob


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Set knobs for the duration of a ``with`` block in this process (tests).

    Raises
    ------
    KeyError
        If a name is not a knob.
    """
    unknown = set(values) - set(_registry)
    if unknown:
        raise KeyError(f"no knob named {', '.join(sorted(unknown))}")
    saved = {name: _overrides[name] for name in values if name in _overrides}
    _overrides.update(values)
    try:
        yield
    finally:
        for name in values:
            _overrides.pop(name, None)
        _overrides.update(saved)


def all_knobs() -> list[Knob]:
    """Every knob, in definition order (for documentation)."""
    return list(_registry.values())


def markdown_table() -> str:
    """The table of every knob that ``docs/operations.md`` carries (``python -m ckptd.knobs``)."""
    rows = ["| variable | default | what it changes |", "| --- | --- | --- |"]
    for knob in all_knobs():
        default = "unset" if knob.default is None else knob.default
        rows.append(f"| `{knob.env}` | `{default}` | {knob.doc} |")
    return "\n".join(rows) + "\n"
