"""The wire contract between ``ckpt_client`` and ``ckptd``: the only module both import.

Pattern: a multipart ZeroMQ message is one msgpack *header* frame followed by zero or
more raw *payload* frames (the serialsocket pattern). The header is a map::

    {"v": SCHEMA_VERSION, "type": <MessageType>, "id": <int>, "body": {...}}

Replies reuse the request's ``id`` and carry ``type`` ``"reply"`` or ``"error"``.
Nothing here pickles: headers are msgpack with two extension types (tensor reference,
tuple) used to describe the *shape* of a state dict; tensor bytes never travel in
messages on one node (they go through the shared-memory staging pool).

This module also owns endpoint discovery (where the socket lives) and the tensor
layout rule inside a staging extent, because both sides must compute them the same
way. It must stay importable without torch.
"""

from __future__ import annotations

import os
import socket as _socket
import stat
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack

SCHEMA_VERSION = 1

#: Largest header frame either side accepts. State-dict skeletons of very large models
#: are a few MiB; anything bigger is a bug or an attack.
MAX_HEADER_BYTES = 32 * 1024 * 1024
#: Largest number of frames in one message.
MAX_FRAMES = 64
#: Largest single raw payload frame (metadata files, CUDA handles); bulk tensor bytes
#: use the staging pool instead.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024

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
    # daemon <-> daemon over the CURVE peer socket (ckptd.replication)
    PEER_PING = "peer_ping"
    PEER_PONG = "peer_pong"
    PART_GET = "part_get"      # ask a holder to stream a part back
    PART_BEGIN = "part_begin"  # a part stream starts: size (and crc when known)
    PART_CHUNK = "part_chunk"  # one raw frame of the part at an offset
    PART_END = "part_end"      # all chunks sent: crc32 of the whole stream
    PART_ACK = "part_ack"      # receiver: bytes received so far (flow control)
    PART_DONE = "part_done"    # receiver: durable and verified (or why not)


#: Body flag of STAGE (DCP format) and COMMIT_FILE: write the files exactly as torch's
#: ``FileSystemWriter`` would (torch's per-record zip CRC32 computed, no ``.ckptd-sum``
#: sidecar beside them); the checksums come back in the results instead. Used by
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


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TENSOR:
        return TensorRef(int.from_bytes(data, "little"))
    if code == _EXT_TUPLE:
        return tuple(unpack_value(data))
    return msgpack.ExtType(code, data)


def pack_value(value: Any) -> bytes:
    """Encode a value (tuples and :class:`TensorRef` kept) as msgpack bytes."""
    return msgpack.packb(value, default=_default, use_bin_type=True, strict_types=True)


def unpack_value(data: bytes) -> Any:
    """Decode bytes made by :func:`pack_value`."""
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
    replies to requests. Replies to earlier requests that timed out are discarded.

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

    def send(self, msg_type: str, body: dict | None = None, frames=()) -> int:
        """Send a request without waiting; returns its id."""
        msg_id = self._next_id
        self._next_id += 1
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
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplyTimeout(f"no reply from {self.endpoint} within {timeout:.1f}s")
            if self.socket.poll(int(min(remaining, slice_seconds) * 1000) + 1):
                reply = decode(self.socket.recv_multipart())
                if reply.id != msg_id:
                    continue  # a late answer to a request we gave up on
                if reply.type == MessageType.ERROR:
                    raise ErrorReply(reply.body)
                return reply
            if still_worth_waiting is not None:
                still_worth_waiting()

    def call(self, msg_type: str, body: dict | None = None, frames=(), timeout: float = 30.0,
             still_worth_waiting=None) -> Message:
        """Send a request and wait for its reply (see :meth:`wait`)."""
        return self.wait(self.send(msg_type, body, frames), timeout, still_worth_waiting)

    def close(self) -> None:
        """Close the socket."""
        self.socket.close(linger=0)
