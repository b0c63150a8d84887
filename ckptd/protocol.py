"""The wire contract between ``ckpt_client`` and ``ckptd``: the only module both import.

Pattern: a multipart ZeroMQ message is one msgpack *header* frame followed by zero or
more raw *payload* frames (the serialsocket pattern). The header is a map::

    {"v": SCHEMA_VERSION, "type": <MessageType>, "id": <int>, "body": {...}}

Replies reuse the request's ``id`` and carry ``type`` ``"reply"`` or ``"error"``.
Nothing here pickles: headers are msgpack with two extension types (tensor reference,
tuple) used to describe the *shape* of a state dict; tensor bytes never travel in
messages on one node (they go through the shared-memory staging pool).

This module also owns the rules both sides must compute the same way: endpoint discovery
(where the socket lives), the tensor layout inside a staging extent, the local-checkpoint
part header, the session-id rule, the order in which a clique's nodes hold a rank's
replicas, and how either side decides that the process at the other end is alive.
Request bodies are typed (:class:`Body` subclasses, checked by :meth:`Body.from_wire`),
so no handler checks a dict by hand. It must stay importable without torch; ``__all__``
is the contract ``ckpt_client`` may use.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket as _socket
import stat
import threading
import time
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Iterable, Sequence

import msgpack

__all__ = [
    # framing and errors
    "SCHEMA_VERSION", "MessageType", "Phase", "SaveFormat", "ErrorCode", "BUFFER_DTYPES",
    "STOCK_FILES",
    "ProtocolError", "TensorRef", "Message", "encode", "decode", "error_body",
    "pack_value", "unpack_value", "fill_skeleton",
    # typed bodies of the client channel
    "Body", "Hello", "Stage", "Staged", "Poll", "Forget", "Abort", "CommitFile",
    "LocalSession", "LocalInventory", "LocalFetch", "LocalCommit", "Empty",
    # staging layout and local parts
    "align_up", "layout_extent", "encode_part_header", "decode_part_header",
    "read_part_header", "PART_FRAME_BYTES",
    # shared rules
    "check_session_id", "holder_order", "process_alive", "is_loopback_address",
    "ipc_export_id", "release_ipc_counters",
    # endpoint discovery and the request channel
    "SOCKET_ENV", "default_runtime_dir", "resolve_socket_path", "ready_file_for", "ready_pid", "wait_until_ready",
    "endpoint_for", "socket_is_live", "ensure_private_dir",
    "Channel", "ReplyTimeout", "ErrorReply",
]

SCHEMA_VERSION = 1

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

#: Alignment of each tensor inside a staging extent: lets any dtype be viewed in place
#: and keeps copies on cache-line boundaries.
TENSOR_ALIGNMENT = 64
#: Alignment of extents in the staging pool (page size, for O_DIRECT-friendly buffers).
EXTENT_ALIGNMENT = 4096


class MessageType:
    """Names of request types (client -> daemon) and reply types."""

    HELLO = "hello"
    GOODBYE = "goodbye"
    STAGE = "stage"              # reserve an extent (CPU path) or stage CUDA handles
    STAGED = "staged"            # client finished copying into its extent
    POLL = "poll"                # phase and results of requests
    FORGET = "forget"            # drop finished requests (and their files if failed)
    ABORT = "abort"              # drop in-flight requests of this rank
    COMMIT_FILE = "commit_file"  # write one small file atomically (DCP .metadata)
    STATUS = "status"
    PING = "ping"
    REPLY = "reply"
    ERROR = "error"
    # local checkpoints (client -> daemon)
    PEER_INFO = "peer_info"              # this daemon's peer address and CURVE public key
    LOCAL_SESSION = "local_session"      # register a session: root, peer table, cliques
    LOCAL_INVENTORY = "local_inventory"  # parts held for a session, verified
    LOCAL_FETCH = "local_fetch"          # get a missing part from peer daemons
    LOCAL_COMMIT = "local_commit"        # all ranks agreed: mark committed, drop older
    # (daemon <-> daemon messages are the peer channel's: ckptd.replication.wire)


#: Body flag of STAGE (DCP format) and COMMIT_FILE: write the files exactly as torch's
#: ``FileSystemWriter`` would (torch's per-record zip CRC32 computed, no ``.ckptd-sum``
#: sidecar beside them); the checksums come back in the results instead. Used by
#: ``ckpt_client.FileSystemWriterAsync``, whose contract is torch's own file layout.
STOCK_FILES = "stock_files"


#: Body flag of STAGE (DCP format) and COMMIT_FILE: write the files exactly as torch's
#: ``FileSystemWriter`` would (torch's per-record zip CRC32 computed, no ``.ckptd-sum``
#: record beside them); the checksums come back in the results instead. Used by
#: ``ckpt_client.FileSystemWriterAsync``, whose contract is torch's own file layout.
STOCK_FILES = "stock_files"


class Phase:
    """Lifecycle of a save request inside the daemon."""

    WAITING_FOR_POOL = "waiting_for_pool"
    STAGING = "staging"
    WRITING = "writing"
    REPLICATING = "replicating"  # local checkpoints: written here, still streaming to peers
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"

    FINISHED = frozenset({DONE, FAILED, ABORTED})


class SaveFormat:
    """What a save request writes."""

    TORCH = "torch"  # one file loadable by torch.load(weights_only=True)
    DCP = "dcp"      # DCP .distcp files; the client commits .metadata afterwards
    LOCAL = "local"  # one local-checkpoint part (see encode_part_header), replicated to peers


#: Element types a staged buffer may have: torch dtype names, plus raw ``bytes`` (DCP
#: byte items). Checked on both sides so nothing else reaches ``getattr(torch, ...)``.
BUFFER_DTYPES = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
    "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
    "float8_e4m3fn", "float8_e5m2", "bytes",
})


class ErrorCode:
    """Machine-readable error codes carried in error replies."""

    MALFORMED = "malformed"
    TOO_LARGE = "too_large"
    BAD_VERSION = "bad_version"
    UNKNOWN_TYPE = "unknown_type"
    BAD_REQUEST = "bad_request"
    PATH_REFUSED = "path_refused"
    POOL_TOO_SMALL = "pool_too_small"
    NOT_REGISTERED = "not_registered"
    UNKNOWN_REQUEST = "unknown_request"
    SHUTTING_DOWN = "shutting_down"
    WRITE_FAILED = "write_failed"
    NOT_CONFIGURED = "not_configured"      # e.g. local checkpoints without --peer-listen
    PART_UNAVAILABLE = "part_unavailable"  # no holder had a verified copy of a part
    ABORTED = "aborted"                    # the save was aborted before it was staged
    DAEMON_RESTARTED = "daemon_restarted"  # the request names an earlier daemon incarnation
    IPC_DENIED = "ipc_denied"              # the OS refused the daemon the trainer's CUDA memory
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message that does not follow this schema.

    Parameters
    ----------
    code : str
        One of :class:`ErrorCode`.
    message : str
        What was wrong, for a human.
    hint : str
        What to do about it.
    """

    def __init__(self, code: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.hint = hint


# --------------------------------------------------------------------------- framing

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


def error_body(code: str, message: str, hint: str = "", **context: Any) -> dict:
    """The body of an error reply: a code, what happened, what to do, and context."""
    return {"code": code, "message": message, "hint": hint, **context}


# --------------------------------------------------------------------- typed bodies

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
        """The body as a msgpack-encodable map."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


_hint_cache: dict[type, dict] = {}


def _hints(cls: type) -> dict:
    if cls not in _hint_cache:
        _hint_cache[cls] = typing.get_type_hints(cls)
    return _hint_cache[cls]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _non_negative(value: Any) -> bool:
    return value is None or value >= 0


def _valid_buffer(entry: Any) -> bool:
    return (isinstance(entry, list) and len(entry) == 3 and entry[0] in BUFFER_DTYPES
            and isinstance(entry[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry[1])
            and isinstance(entry[2], int) and not isinstance(entry[2], bool) and entry[2] >= 0)


def _plain_file_name(name: Any) -> bool:
    return (isinstance(name, str) and bool(name) and "/" not in name and "\x00" not in name
            and not name.startswith("."))


def _valid_files(entries: Any) -> bool:
    return all(isinstance(e, list) and len(e) == 2 and _plain_file_name(e[0])
               and isinstance(e[1], list)
               and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in e[1])
               for e in entries)


def _valid_peers(peers: Any) -> bool:
    # [control address, public key] or, since bulk streams, [..., bulk address host:port]
    return all(p is None or (isinstance(p, list) and len(p) in (2, 3)
                             and all(isinstance(x, str) for x in p)) for p in peers)


class Empty(Body):
    """A request with nothing in its body (status, ping, goodbye, peer info)."""


class Hello(Body, message="hello"):
    """A trainer process registers with its daemon."""

    rank: int = check(lambda v: v >= 0, "a rank >= 0")
    pid: int = check(lambda v: v > 0, "a process id")
    world_size: int = check(lambda v: v >= 1, "a world size >= 1", 1)


class Stage(Body, message="stage"):
    """Reserve staging space for a save; buffers with a CUDA IPC spec are the daemon's to copy.

    ``buffers`` lists ``[dtype, shape, nbytes]`` in staging order; ``files`` (DCP) maps
    each output file name to the buffer indices it holds; ``cuda`` (mixed transport) has
    one entry per buffer: an IPC spec the daemon copies from, or None for a buffer the
    trainer copies into shared memory itself.
    """
    format: str = check(lambda v: v in (SaveFormat.TORCH, SaveFormat.DCP, SaveFormat.LOCAL),
                        "one of torch, dcp, local")
    path: str
    buffers: list = check(lambda v: all(_valid_buffer(b) for b in v),
                          "a list of [dtype name, shape list, byte count]")
    skeleton: bytes = b""
    files: list = check(_valid_files, "a list of [plain file name, [buffer indices]]", [])
    cuda: list | None = None  # per buffer: a CUDA IPC spec the daemon copies from, or None
    session: str | None = None
    iteration: int | None = check(_non_negative, "an iteration >= 0", None)
    stock_files: bool = False

    def check_together(self) -> None:
        """File entries name existing buffers; a local part names its iteration."""
        for name, indices in self.files:
            if any(i >= len(self.buffers) for i in indices):
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"stage: file {name!r} names a buffer beyond the "
                                    f"{len(self.buffers)} described")
        if self.format == SaveFormat.LOCAL and self.iteration is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stage: a local part needs 'iteration'")
        if self.cuda is not None and (len(self.cuda) != len(self.buffers) or not all(
                spec is None or isinstance(spec, dict) for spec in self.cuda)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stage: 'cuda' needs one entry (a spec "
                                "or null) per buffer, in order")


class Staged(Body, message="staged"):
    """The client finished copying a request's tensors into its extent."""

    request_id: int


class Poll(Body, message="poll"):
    """Phase and results of some of this connection's requests."""

    request_ids: list[int] = field(default_factory=list)


class Forget(Body, message="forget"):
    """Drop finished requests (and the files of failed ones)."""

    request_ids: list[int] = field(default_factory=list)
    delete_files: bool = False


class Abort(Body, message="abort"):
    """Drop in-flight requests of this connection (all of them when ``request_ids`` is None)."""

    request_ids: list[int] | None = None


class CommitFile(Body, message="commit_file"):
    """Write one small file atomically (DCP ``.metadata``); its bytes are the one frame."""

    path: str
    stock_files: bool = False


class LocalSession(Body, message="local_session"):
    """Register a local-checkpoint session: its root, every rank's daemon, the cliques."""

    root: str
    session: str = ""
    world_size: int = 1
    peers: list = check(_valid_peers, "a list of [address, key, bulk address] (or null) per "
                        "rank", [])
    cliques: list[list[int]] = field(default_factory=list)


class LocalInventory(Body, message="local_inventory"):
    """The parts this node holds for a session, verified."""

    session: str = ""


class LocalFetch(Body, message="local_fetch"):
    """Get a part this node lacks from the holders, in the order given."""

    iteration: int = check(lambda v: v >= 0, "an iteration >= 0")
    owner: int = check(lambda v: v >= 0, "a rank >= 0")
    session: str = ""
    holders: list[str] = field(default_factory=list)


class LocalCommit(Body, message="local_commit"):
    """Every rank's save of an iteration is durable: mark it committed, drop older ones."""

    iteration: int = check(lambda v: v >= 0, "an iteration >= 0")
    session: str = ""


# ------------------------------------------------------------------- staging layout

def align_up(value: int, alignment: int) -> int:
    """Round ``value`` up to a multiple of ``alignment``."""
    return (value + alignment - 1) // alignment * alignment


def layout_extent(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Offsets of consecutive buffers inside one staging extent, and its total size.

    Both the client (which copies into the extent) and the daemon (which reads from it)
    call this, so they agree without sending offsets around.
    """
    offsets, cursor = [], 0
    for size in nbytes:
        offsets.append(cursor)
        cursor = align_up(cursor + size, TENSOR_ALIGNMENT)
    return offsets, align_up(max(cursor, 1), EXTENT_ALIGNMENT)


# ------------------------------------------------------------ local checkpoint parts

#: First bytes of a local-checkpoint part file.
PART_MAGIC = b"CKPTDPT1"
#: Replication streams parts in frames of this size (SPEC §6: a few MiB moves fastest).
PART_FRAME_BYTES = 4 * 1024 * 1024


def encode_part_header(skeleton: bytes, buffers: Sequence[list], owner: int, iteration: int,
                       session: str) -> bytes:
    """The first bytes of a part file: magic, header length, msgpack header.

    The buffers' raw bytes follow the header back to back, in order, without padding,
    so a part is readable without unpickling anything and streams as one byte range.
    """
    header = pack_value({"skeleton": skeleton, "buffers": [list(b) for b in buffers],
                         "owner": owner, "iteration": iteration, "session": session})
    return PART_MAGIC + len(header).to_bytes(8, "little") + header


def decode_part_header(prefix: bytes) -> tuple[dict, int]:
    """Parse the header at the start of a part file.

    Returns
    -------
    (header, data_offset)
        The header map and where the first buffer's bytes start.

    Raises
    ------
    ProtocolError
        If ``prefix`` does not start with a complete, valid part header.
    """
    fixed = len(PART_MAGIC) + 8
    if len(prefix) < fixed or prefix[:len(PART_MAGIC)] != PART_MAGIC:
        raise ProtocolError(ErrorCode.MALFORMED, "not a ckptd local-checkpoint part",
                            "the file does not start with the part magic")
    length = int.from_bytes(prefix[len(PART_MAGIC):fixed], "little")
    if length > MAX_HEADER_BYTES or len(prefix) < fixed + length:
        raise ProtocolError(ErrorCode.MALFORMED, f"part header of {length} bytes is truncated "
                            "or too large")
    header = unpack_value(bytes(prefix[fixed:fixed + length]))
    if not isinstance(header, dict) or not isinstance(header.get("buffers"), list):
        raise ProtocolError(ErrorCode.MALFORMED, "part header is not a map with 'buffers'")
    return header, fixed + length


def read_part_header(read: Callable[[int], bytes]) -> tuple[dict, int]:
    """Read and parse a part header from a stream (``read(n)`` returns up to ``n`` bytes).

    Raises
    ------
    ProtocolError
        As :func:`decode_part_header`.
    """
    fixed = read(len(PART_MAGIC) + 8)
    length = int.from_bytes(fixed[len(PART_MAGIC):], "little") if len(fixed) == len(PART_MAGIC) + 8 else 0
    return decode_part_header(fixed + read(min(length, MAX_HEADER_BYTES)))


# ------------------------------------------------------------------ shared rules

_SESSION_RE = re.compile(r"[A-Za-z0-9_.\-]{0,128}")


def check_session_id(session_id: Any) -> str:
    """Return ``session_id`` if it is a safe single path component (or empty).

    Raises
    ------
    ValueError
        For ids with ``/``, ``..`` or characters other than letters, digits, ``_.-``.
    """
    if (not isinstance(session_id, str) or not _SESSION_RE.fullmatch(session_id)
            or session_id in (".", "..")):
        raise ValueError(f"session id {session_id!r} is not a plain name; use letters, "
                         "digits, '_', '.', '-' (at most 128)")
    return session_id


def holder_order(clique: Sequence[int], owner: int) -> list[int]:
    """The clique mates that keep ``owner``'s replicas, in the order they are used.

    The mates after the owner in clique order, wrapping around: the daemon pushes to
    them in this order and the client fetches from them in this order, so both agree.
    """
    at = list(clique).index(owner)
    return list(clique[at + 1:]) + list(clique[:at])


def is_loopback_address(address: str) -> bool:
    """Whether ``tcp://host:port``, ``host:port`` or a host names a loopback address (one
    only the same host, in the same network namespace, can reach)."""
    import ipaddress

    host = address.removeprefix("tcp://")
    if host.startswith("[") or host.count(":") == 1:
        host = host.rpartition(":")[0]
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: whoever resolves it decides
        return False


def ipc_export_id(spec: dict) -> tuple:
    """Which export a CUDA IPC description is: torch gives every export of a storage its
    own reference-counter slot, and each slot is owed exactly one release."""
    return (spec["ref_counter_handle"], spec["ref_counter_offset"])


def release_ipc_counters(specs) -> None:
    """Pay the release each description's export is owed (torch's
    ``_release_ipc_counter_cuda``), once per export; a counter file already gone means its
    trainer is gone too, and is skipped."""
    import torch  # only a side that holds CUDA descriptions calls this

    for export in {ipc_export_id(spec) for spec in specs}:
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*export)  # noqa: SLF001
        except Exception as exc:
            logging.getLogger(__name__).debug("could not release IPC counter %s: %s", export, exc)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (how each side watches the other)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


# ------------------------------------------------------------------ endpoint discovery

SOCKET_ENV = "CKPTD_SOCKET"
SOCKET_NAME = "ckptd.sock"
READY_FILE_NAME = "ckptd.ready"
#: Longest path an ``ipc://`` endpoint may have (sun_path is 108 bytes with the NUL).
MAX_SOCKET_PATH = 107


def default_runtime_dir() -> str:
    """Directory for the socket when none is configured.

    ``$XDG_RUNTIME_DIR/ckptd`` when the session has one, else ``/tmp/ckptd-<uid>``.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "ckptd")
    return f"/tmp/ckptd-{os.getuid()}"


def resolve_socket_path(socket: str | os.PathLike | None = None) -> str:
    """The socket path: the argument, else ``$CKPTD_SOCKET``, else the default."""
    if socket:
        return os.path.abspath(os.fspath(socket))
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return os.path.abspath(from_env)
    return os.path.join(default_runtime_dir(), SOCKET_NAME)


def ready_file_for(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` writes its ready file."""
    return os.path.join(os.path.dirname(socket_path), READY_FILE_NAME)


def ready_pid(socket_path: str) -> int | None:
    """The pid in the ready file of the daemon serving ``socket_path`` (None if none)."""
    try:
        with open(ready_file_for(socket_path)) as f:
            return json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return None


def wait_until_ready(socket_path: str, process, timeout: float) -> str | None:
    """Wait until ``process`` (a ``ckptd serve`` just started for ``socket_path``) has
    written its ready file.

    Returns
    -------
    str or None
        ``None`` once it is ready; else why not (it exited, or the time ran out), for the
        caller's own error.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            return f"exited with status {process.returncode} before it was ready"
        if ready_pid(socket_path) == process.pid:
            return None
        if time.monotonic() > deadline:
            return f"was not ready within {timeout:.0f}s"
        time.sleep(0.05)  # the daemon writes the file atomically; nothing to be woken by


def endpoint_for(socket_path: str) -> str:
    """The ZeroMQ endpoint for a socket path, checking its length first."""
    if len(socket_path) > MAX_SOCKET_PATH:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"socket path {socket_path!r} is {len(socket_path)} bytes; unix sockets allow "
            f"{MAX_SOCKET_PATH}",
            "choose a shorter --socket / CKPTD_SOCKET path",
        )
    return f"ipc://{socket_path}"


def socket_is_live(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError:
        return os.path.exists(path)
    finally:
        probe.close()


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check an existing one is ours and closed to others.

    Raises
    ------
    PermissionError
        If the directory belongs to another user or others can enter it.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"socket directory {path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); "
            "pick another --socket path")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)


# ------------------------------------------------------------------ request channel

class ReplyTimeout(Exception):
    """No reply arrived in time."""


class ErrorReply(Exception):
    """The peer answered with an error reply.

    Attributes
    ----------
    body : dict
        The error body: ``code``, ``message``, ``hint`` and context fields.
    """

    def __init__(self, body: dict) -> None:
        super().__init__(body.get("message", "error"))
        self.body = body
        self.code = body.get("code")


class Channel:
    """A DEALER socket that sends requests and waits for the matching reply.

    Used by the trainer library and by ``ckptd status``: the one place that matches
    replies to requests. Safe to use from several threads at once (a trainer's main
    thread polls while a background thread stages a zero-stall save): one lock guards
    the socket, and a reply that arrives for another waiting thread is kept for it.
    Replies to requests nobody waits for any more (they timed out) are discarded.

    Parameters
    ----------
    endpoint : str
        ZeroMQ endpoint of the daemon.
    context : zmq.Context, optional
        Context to create the socket in (default: the process-wide instance).
    """

    def __init__(self, endpoint: str, context=None) -> None:
        import zmq

        self._zmq = zmq
        self.endpoint = endpoint
        self.socket = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(endpoint)
        self._next_id = 1
        self._lock = threading.Lock()
        self._awaited: set[int] = set()       # ids some thread still waits for
        self._arrived: dict[int, Message] = {}  # their replies, when another thread read them

    def send(self, msg_type: str, body: dict | None = None, frames=()) -> int:
        """Send a request without waiting; returns its id."""
        with self._lock:
            msg_id = self._next_id
            self._next_id += 1
            self._awaited.add(msg_id)
            self.socket.send_multipart(encode(msg_type, msg_id, body, frames), copy=False)
        return msg_id

    def wait(self, msg_id: int, timeout: float, still_worth_waiting=None,
             slice_seconds: float = 0.1) -> Message:
        """Wait for the reply to ``msg_id``.

        Parameters
        ----------
        timeout : float
            Seconds before :class:`ReplyTimeout`.
        still_worth_waiting : callable, optional
            Called between slices; raise from it to stop waiting (e.g. the daemon died).

        Raises
        ------
        ReplyTimeout, ErrorReply, ProtocolError
        """
        import time

        deadline = time.monotonic() + timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ReplyTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s")
                reply = self._receive(msg_id, min(remaining, slice_seconds))
                if reply is not None:
                    if reply.type == MessageType.ERROR:
                        raise ErrorReply(reply.body)
                    return reply
                if still_worth_waiting is not None:
                    still_worth_waiting()
        finally:
            with self._lock:
                self._awaited.discard(msg_id)
                self._arrived.pop(msg_id, None)

    def _receive(self, msg_id: int, seconds: float) -> Message | None:
        """One slice of waiting: ``msg_id``'s reply if it came, else ``None``."""
        import time

        deadline = time.monotonic() + seconds
        while True:
            with self._lock:
                if msg_id in self._arrived:
                    return self._arrived.pop(msg_id)
                # Short polls while holding the lock, so other waiting threads get their
                # turn at the socket (and at the replies it delivers for them).
                left = deadline - time.monotonic()
                if self.socket.poll(max(1, int(min(left, 0.01) * 1000))):
                    reply = decode(self.socket.recv_multipart())
                    if reply.id == msg_id:
                        return reply
                    if reply.id in self._awaited:
                        self._arrived[reply.id] = reply
                    continue  # else: a late answer to a request we gave up on
            if time.monotonic() >= deadline:
                return None

    def call(self, msg_type: str, body: dict | None = None, frames=(), timeout: float = 30.0,
             still_worth_waiting=None) -> Message:
        """Send a request and wait for its reply (see :meth:`wait`)."""
        return self.wait(self.send(msg_type, body, frames), timeout, still_worth_waiting)

    def close(self) -> None:
        """Close the socket."""
        self.socket.close(linger=0)
