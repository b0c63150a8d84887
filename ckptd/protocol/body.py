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


def _always(value: Any) -> bool:
    return True


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_conformance_cache: dict = {}


def _conformance(annotation: Any) -> Callable[[Any], bool]:
    """Whether a decoded msgpack value has the type a body field declares: the check
    for ``annotation``, built once per annotation:
    every message of the serve loop (a trainer polls every few milliseconds) checks its
    fields, and walking the annotation each time cost more than the checks themselves."""
    try:
        return _conformance_cache[annotation]
    except KeyError:
        pass
    except TypeError:  # an annotation that cannot be a key: built each time
        return _build_conformance(annotation)
    check = _conformance_cache[annotation] = _build_conformance(annotation)
    return check


def _build_conformance(annotation: Any) -> Callable[[Any], bool]:
    if annotation is Any:
        return _always
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = tuple(_conformance(option) for option in typing.get_args(annotation))
        return lambda value: any(option(value) for option in options)
    if annotation is type(None):
        return lambda value: value is None
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        item_check = _conformance(item)
        return lambda value: isinstance(value, list) and all(item_check(v) for v in value)
    if origin is dict:
        key, item = typing.get_args(annotation) or (Any, Any)
        key_check, item_check = _conformance(key), _conformance(item)
        return lambda value: isinstance(value, dict) and all(
            key_check(k) and item_check(v) for k, v in value.items())
    if isinstance(annotation, type) and issubclass(annotation, Body):
        return lambda value: isinstance(value, annotation)
    if annotation is int:
        return _is_int
    if annotation is float:
        return _is_number
    if annotation in (list, dict, str, bytes, bool):
        return lambda value: isinstance(value, annotation)
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
        values = {}
        for name, optional, nested, annotation, conforms, predicate, expected in _plan(cls):
            if name in body:
                value = body[name]
            elif optional:
                continue
            else:
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"{cls.message_type or cls.__name__} needs '{name}'",
                                    "install the same ckptd version for daemon and trainers")
            if nested:
                value = _build(value, annotation, f"{cls.message_type or cls.__name__}.{name}")
            if not conforms(value) or (predicate and not predicate(value)):
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"{cls.message_type or cls.__name__}: '{name}' = "
                                    f"{_short(value)} is not {expected}")
            values[name] = value
        body = cls(**values)
        body.check_together()
        return body

    def check_together(self) -> None:
        """Checks that involve several fields; raise :class:`ProtocolError` (override)."""

    def to_wire(self) -> dict:
        """The body as a msgpack-encodable map (bodies it holds become maps too)."""
        return {name: _unbuild(getattr(self, name)) if nested else getattr(self, name)
                for name, _, nested, *_ in _plan(type(self))}


_plan_cache: dict[type, tuple] = {}


def _plan(cls: type) -> tuple:
    """Per field of ``cls``, what :meth:`Body.from_wire` and :meth:`Body.to_wire` need:
    ``(name, optional, nested, annotation, conforms, predicate, expected)``, worked out
    once per body type rather than on every message."""
    plan = _plan_cache.get(cls)
    if plan is None:
        hints, nested = _hints(cls), _nested_fields(cls)
        plan = _plan_cache[cls] = tuple(
            (f.name, f.default is not MISSING or f.default_factory is not MISSING,
             f.name in nested, hints[f.name], _conformance(hints[f.name]),
             f.metadata.get("check"), f.metadata.get("expected") or str(hints[f.name]))
            for f in fields(cls))
    return plan


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
