"""Typed message bodies: a frozen dataclass per message, checked field by field.

Owns :class:`Body` (the schema is the dataclass's fields; :meth:`Body.from_wire` checks a
received map, :meth:`Body.to_wire` gives the map a sender sends), :func:`check` (a field
with a rule beyond its type) and :class:`Empty`. A field may hold bodies itself (``Entry``,
``list[Entry]``, ``dict[int, Entry]``, ``Entry | None``): they are built and checked on
receipt and turned back into maps on sending, so a nested entry is as typed as its parent. Every channel's vocabulary is built from
these, so no handler checks a dict by hand. It must not name any particular channel's
messages.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar

from ckptd.protocol.errors import ProtocolError
from ckptd.protocol.names import ErrorCode

__all__ = ["Body", "check", "Empty"]


def _conforms(value: Any, annotation: Any) -> bool:
    """Whether a decoded msgpack value has the type a body field declares."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, option) for option in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return isinstance(value, list) and all(_conforms(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation) or (Any, Any)
        return isinstance(value, dict) and all(_conforms(k, key) and _conforms(v, item)
                                               for k, v in value.items())
    if isinstance(annotation, type) and issubclass(annotation, Body):
        return isinstance(value, annotation)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation in (list, dict, str, bytes, bool):
        return isinstance(value, annotation)
    raise TypeError(f"body fields cannot be declared as {annotation!r}")


def check(predicate: Callable[[Any], bool], expected: str, default: Any = MISSING) -> Any:
    """A body field with a check beyond its type (``expected`` says what is wanted)."""
    metadata = {"check": predicate, "expected": expected}
    if default is MISSING:
        return field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


class Body:
    """Base of a typed message body: the fields of a frozen dataclass are the schema.

    A subclass names its message type in its bases (``class Staged(Body,
    message="staged")``) and declares its fields; it becomes a frozen dataclass.
    :meth:`from_wire` checks every field against its annotation (and its :func:`check`,
    if any) and raises :class:`ProtocolError` with code ``bad_request`` naming the field,
    so a handler receives only well-formed bodies. Unknown keys are ignored, which lets
    a newer client add optional fields.
    """

    message_type: ClassVar[str] = ""

    def __init_subclass__(cls, message: str = "", **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.message_type = message
        dataclass(frozen=True)(cls)

    @classmethod
    def from_wire(cls, body: dict) -> "Body":
        """Build and check a body from a decoded message.

        Raises
        ------
        ProtocolError
            If a required field is missing or a field has the wrong type or value.
        """
        hints = _hints(cls)
        values = {}
        for f in fields(cls):
            if f.name in body:
                value = body[f.name]
            elif f.default is not MISSING or f.default_factory is not MISSING:
                continue
            else:
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"{cls.message_type or cls.__name__} needs '{f.name}'",
                                    "install the same ckptd version for daemon and trainers")
            if f.name in _nested_fields(cls):
                value = _build(value, hints[f.name], f"{cls.message_type or cls.__name__}."
                                                     f"{f.name}")
            predicate = f.metadata.get("check")
            if not _conforms(value, hints[f.name]) or (predicate and not predicate(value)):
                expected = f.metadata.get("expected") or str(hints[f.name])
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"{cls.message_type or cls.__name__}: '{f.name}' = "
                                    f"{_short(value)} is not {expected}")
            values[f.name] = value
        body = cls(**values)
        body.check_together()
        return body

    def check_together(self) -> None:
        """Checks that involve several fields; raise :class:`ProtocolError` (override)."""

    def to_wire(self) -> dict:
        """The body as a msgpack-encodable map (bodies it holds become maps too)."""
        nested = _nested_fields(type(self))
        return {f.name: _unbuild(getattr(self, f.name)) if f.name in nested
                else getattr(self, f.name) for f in fields(self)}


_hint_cache: dict[type, dict] = {}


def _hints(cls: type) -> dict:
    if cls not in _hint_cache:
        _hint_cache[cls] = typing.get_type_hints(cls)
    return _hint_cache[cls]


def _holds_bodies(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, Body):
        return True
    return any(_holds_bodies(a) for a in typing.get_args(annotation))


_nested_cache: dict[type, frozenset] = {}


def _nested_fields(cls: type) -> frozenset:
    """Names of the fields of ``cls`` whose type holds bodies (built on receipt)."""
    if cls not in _nested_cache:
        hints = _hints(cls)
        _nested_cache[cls] = frozenset(f.name for f in fields(cls) if _holds_bodies(hints[f.name]))
    return _nested_cache[cls]


def _build(value: Any, annotation: Any, where: str) -> Any:
    """Turn the maps of a received value into the bodies its annotation declares; a value
    of the wrong shape is left as it is, for the caller's type check to name."""
    if isinstance(annotation, type) and issubclass(annotation, Body):
        if not isinstance(value, dict):
            return value
        try:
            return annotation.from_wire(value)
        except ProtocolError as exc:
            raise ProtocolError(exc.code, f"{where}: {exc.message}", exc.hint) from None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        option = next((a for a in args if _holds_bodies(a)), None)
        return value if value is None or option is None else _build(value, option, where)
    if origin is list and isinstance(value, list):
        return [_build(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict and isinstance(value, dict):
        return {k: _build(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
    return value


def _unbuild(value: Any) -> Any:
    if isinstance(value, Body):
        return value.to_wire()
    if isinstance(value, list):
        return [_unbuild(v) for v in value]
    if isinstance(value, dict):
        return {k: _unbuild(v) for k, v in value.items()}
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Empty(Body):
    """A request with nothing in its body (status, ping, goodbye, peer info)."""
