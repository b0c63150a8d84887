"""The names both ends of the client channel spell the same way.

Owns the schema version, the message type names, a save's phases and formats, the error
codes, the dtypes a staged buffer may have and the ``stock_files`` body flag. Plain
constants only: it must not import anything, so every other protocol module can use it.
"""

from __future__ import annotations

__all__ = ["SCHEMA_VERSION", "MessageType", "Phase", "SaveFormat", "ErrorCode", "BUFFER_DTYPES",
           "STOCK_FILES"]

SCHEMA_VERSION = 1


class MessageType:
    """Names of request types (client -> daemon) and reply types."""

    HELLO = "hello"
    GOODBYE = "goodbye"
    STAGE = "stage"              # reserve an extent (CPU path) or stage CUDA handles
    STAGED = "staged"            # client finished copying into its extent
    COPIED = "copied"            # client's copy reached a point of its extent (no wait)
    POLL = "poll"                # phase and results of requests
    FORGET = "forget"            # drop finished requests (and their files if failed)
    ABORT = "abort"              # drop in-flight requests of this rank
    COMMIT_FILE = "commit_file"  # write one small file atomically (DCP .metadata)
    STATUS = "status"
    TRACE = "trace"              # recent saves' spans as Chrome trace events (ckptd trace)
    TRACE_SPANS = "trace_spans"  # a trainer's own spans of a save
    PING = "ping"
    REPLY = "reply"
    ERROR = "error"
    # local checkpoints (client -> daemon)
    PEER_INFO = "peer_info"              # this daemon's peer address and CURVE public key
    LOCAL_SESSION = "local_session"      # register a session: root, peer table, cliques
    LOCAL_INVENTORY = "local_inventory"  # parts held for a session, verified
    LOCAL_FETCH = "local_fetch"          # get a missing part from peer daemons
    LOCAL_COMMIT = "local_commit"        # all ranks agreed: mark committed, drop older
    HANDOVER = "handover"                # tiered DCP save: the commit its daemon will make
    # (daemon <-> daemon messages are the peer channel's: ckptd.replication.wire)


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
    FLUSHING = "flushing"        # tiered saves: durable in the stage dir, copying to the target
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
    STAGE_FULL = "stage_full"              # --stage-policy refuse: the stage budget is full
    LAYOUT_UNKNOWN = "layout_unknown"      # a STAGE named a layout the daemon no longer keeps
    INTERNAL = "internal"
