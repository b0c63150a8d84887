"""Framing: how one message becomes ZeroMQ frames and back, with the size limits.

Pattern: a multipart ZeroMQ message is one msgpack *header* frame followed by zero or
more raw *payload* frames (the serialsocket pattern). The header is a map::

    {"v": SCHEMA_VERSION, "type": <MessageType>, "id": <int>, "body": {...}}

Replies reuse the request's ``id`` and carry ``type`` ``"reply"`` or ``"error"``.
Nothing here pickles: headers are msgpack with two extension types (tensor reference,
tuple) used to describe the *shape* of a state dict; tensor bytes never travel in
messages on one node (they go through the shared-memory staging pool).

Owns the header layout, the two extension types, the limits a received message must
respect and :func:`pack_value` / :func:`unpack_value`, which other formats (part headers,
peer messages) reuse. It must not know what a body means: typed bodies check that.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack

from ckptd.protocol.errors import ProtocolError
from ckptd.protocol.names import SCHEMA_VERSION, ErrorCode

__all__ = ["MAX_HEADER_BYTES", "MAX_FRAMES", "MAX_PAYLOAD_BYTES", "MAX_TUPLE_NESTING",
           "TensorRef", "fill_skeleton", "pack_value", "packed_tensor_ref", "unpack_value",
           "encode", "Message",
           "decode"]

#: Largest header frame either side accepts. State-dict skeletons of very large models
#: are a few MiB; anything bigger is a bug or an attack.
MAX_HEADER_BYTES = 32 * 1024 * 1024
#: Largest number of frames in one message.
MAX_FRAMES = 64
#: Largest single raw payload frame (metadata files, CUDA handles); bulk tensor bytes
#: use the staging pool instead.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
#: Deepest nesting of tuple extensions in one value. Each level is decoded by a nested
#: call of msgpack's C unpacker, whose frames are large: about a thousand levels overflow
#: the C stack and kill the process, so a peer could crash a daemon with a 4 KB frame.
#: State-dict skeletons nest tuples a few levels at most.
MAX_TUPLE_NESTING = 32

_EXT_TENSOR = 1
_EXT_TUPLE = 2


@dataclass(frozen=True)
class TensorRef:
    """Placeholder for the ``index``-th tensor of a flattened state dict."""

    index: int


def fill_skeleton(value: Any, tensors: Sequence) -> Any:
    """Rebuild a structure by replacing each :class:`TensorRef` with its tensor."""
    if isinstance(value, TensorRef):
        return tensors[value.index]
    if isinstance(value, dict):
        return {k: fill_skeleton(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_skeleton(v, tensors) for v in value]
    if isinstance(value, tuple):
        return tuple(fill_skeleton(v, tensors) for v in value)
    return value


#: ``_PACKED_REFS[i]`` is the packed reference to tensor ``i``. Each entry is stored by one
#: ``dict.setdefault`` (one C call, atomic under the GIL) at the key it was built from,
#: with no lock: trainer threads flatten state dicts concurrently, and a signal handler
#: may flatten one while its own thread is in here (a lock would deadlock it); an entry
#: stored at the wrong key would point a skeleton at the wrong tensor (a wrong checkpoint
#: whose checksums all pass).
_PACKED_REFS: dict[int, msgpack.ExtType] = {}


def packed_tensor_ref(index: int) -> msgpack.ExtType:
    """What :func:`pack_value` writes for ``TensorRef(index)``, made once per index.

    A flatten of thousands of tensors puts these in its skeleton directly: msgpack packs
    them natively, where a :class:`TensorRef` costs a call of the encoder's hook each.
    Safe to call from any thread, and from a signal handler.
    """
    ref = _PACKED_REFS.get(index)
    if ref is None:  # the first racer's entry stays; every one is built from its own key
        ref = _PACKED_REFS.setdefault(
            index, msgpack.ExtType(_EXT_TENSOR, index.to_bytes(8, "little")))
    return ref


def _default(obj: Any) -> Any:
    if isinstance(obj, TensorRef):
        return msgpack.ExtType(_EXT_TENSOR, obj.index.to_bytes(8, "little"))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_EXT_TUPLE, pack_value(list(obj)))
    if isinstance(obj, dict):  # OrderedDict and friends: state dicts usually are one
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    raise TypeError(f"cannot encode a value of type {type(obj).__name__} in a ckptd message")


_nesting = threading.local()


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        if len(data) != 8:
            raise ValueError(f"a tensor reference has 8 bytes, not {len(data)}")
        return TensorRef(int.from_bytes(data, "little"))
    if code == _EXT_TUPLE:
        depth = getattr(_nesting, "depth", 0)
        if depth >= MAX_TUPLE_NESTING:
            raise ValueError(f"tuples nested deeper than {MAX_TUPLE_NESTING} levels")
        _nesting.depth = depth + 1
        try:
            return tuple(unpack_value(data))
        finally:
            _nesting.depth = depth
    raise ValueError(f"unknown msgpack extension type {code}")


def pack_value(value: Any) -> bytes:
    """Encode a value (tuples and :class:`TensorRef` kept) as msgpack bytes."""
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def unpack_value(data: bytes) -> Any:
    """Decode bytes made by :func:`pack_value`.

    Bounded: tuples nest at most :data:`MAX_TUPLE_NESTING` levels (msgpack bounds plain
    arrays and maps itself), so hostile bytes raise instead of exhausting the stack.

    Raises
    ------
    ValueError
        (or another msgpack error) for bytes that are not a valid, bounded value.
    """
    return msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, strict_map_key=False)


def encode(msg_type: str, msg_id: int, body: dict | None = None,
           frames: Iterable[bytes | memoryview] = ()) -> list:
    """Build the frames of one message.

    Parameters
    ----------
    msg_type : str
        A :class:`MessageType` name.
    msg_id : int
        Request id; replies echo it.
    body : dict, optional
        The header body (msgpack-encodable, tuples and :class:`TensorRef` allowed).
    frames : iterable of bytes
        Raw payload frames sent after the header without copying.

    Returns
    -------
    list
        Frames ready for ``socket.send_multipart``.
    """
    header = pack_value({"v": SCHEMA_VERSION, "type": msg_type, "id": msg_id,
                         "body": body or {}})
    return [header, *frames]


@dataclass
class Message:
    """A decoded message: header fields plus raw payload frames."""

    type: str
    id: int
    body: dict
    frames: list


def decode(frames: Sequence[bytes | memoryview]) -> Message:
    """Parse and validate the frames of one message.

    Raises
    ------
    ProtocolError
        If the message is empty, too large, not msgpack, of another schema version,
        or lacks the required header fields.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED, "empty message",
                            "send a msgpack header frame first")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"message has {len(frames)} frames; the limit is {MAX_FRAMES}")
    raw_header = frames[0]
    if len(raw_header) > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE,
                            f"header of {len(raw_header)} bytes exceeds {MAX_HEADER_BYTES}",
                            "state dicts with huge non-tensor values should store them as tensors")
    for payload in frames[1:]:
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise ProtocolError(ErrorCode.TOO_LARGE,
                                f"payload frame of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        header = unpack_value(bytes(raw_header))
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED, "header is not a map")
    version = header.get("v")
    if version != SCHEMA_VERSION:
        raise ProtocolError(
            ErrorCode.BAD_VERSION,
            f"schema version {version!r} is not supported (this side speaks {SCHEMA_VERSION})",
            "install the same ckptd version for the daemon and the trainers",
        )
    msg_type, msg_id, body = header.get("type"), header.get("id"), header.get("body", {})
    if not isinstance(msg_type, str) or not isinstance(msg_id, int) or not isinstance(body, dict):
        raise ProtocolError(ErrorCode.MALFORMED,
                            "header needs 'type' (str), 'id' (int) and 'body' (map)")
    return Message(msg_type, msg_id, body, list(frames[1:]))
