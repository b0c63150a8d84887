"""The client channel's answers: the typed body of every reply the daemon sends a trainer.

Owns one :class:`~ckptd.protocol.body.Body` subclass per reply (and the entries some of
them hold), and :data:`REPLIES`, which request type is answered with which body. The
daemon's handlers build these and its endpoint refuses to send anything else; the client
turns every reply into its type on receipt. A renamed field therefore fails at both
ends: the daemon cannot build the body, the client cannot read it.

Unknown keys in a reply are ignored (dropped from the typed body), like in a request: a
newer daemon may add an optional field without breaking an older client. A field a newer
client added must have a default, so that it can still read an older daemon's replies.

The status document (``ckptd status --json``) is not a reply body here: it has its own
schema, versioned by its ``schema`` field and documented for operators, and is passed on
as a map. It must not hold the handlers.
"""

from __future__ import annotations

from dataclasses import field

from ckptd.protocol.body import Body, Empty, check
from ckptd.protocol.names import MessageType

__all__ = ["DaemonDeadlines", "HelloReply", "StageReply", "StagedReply", "WrittenFile", "RequestState",
           "PollReply", "ForgetReply", "AbortReply", "CommitFileReply", "HandoverReply",
           "PingReply", "PeerInfoReply", "LocalSessionReply", "HeldPart", "LocalInventoryReply",
           "LocalFetchReply", "LocalCommitReply", "TraceSpansReply", "REPLIES", "reply_type_for"]


def _seconds() -> float:
    return check(lambda s: s > 0, "a positive number of seconds")


class DaemonDeadlines(Body):
    """The deadlines a daemon enforces, in seconds, as it runs (its command line and its
    own environment, which need not be the trainer's): a trainer makes each of its waits
    at least the daemon's deadline for the same thing plus a margin, so the daemon stays
    the judge of a save even when it was started with longer limits than the trainer's
    environment names."""

    stall_timeout_s: float = _seconds()       # --stall-timeout: a write or fsync without progress
    stage_timeout_s: float = _seconds()       # a STAGE without staging space, from its arrival
    staging_deadline_s: float = _seconds()    # the copies into the pool, from the space granted
    save_deadline_s: float = _seconds()       # a whole save, request to durable
    flush_deadline_s: float = _seconds()      # a tiered save's flush to its target
    local_load_timeout_s: float = _seconds()  # a fetch of a local part
    serve_tick_s: float = _seconds()          # how often the daemon checks all of these


class HelloReply(Body):
    """The daemon a trainer registered with: who it is, its staging pool, and the
    deadlines it enforces (``None`` from a daemon that predates them)."""

    daemon_pid: int
    incarnation: str  # random per daemon start; every later request names it
    version: str
    pool_path: str
    pool_size: int
    writers: int = 1
    host: str | None = None
    cuda: bool = False
    cuda_devices: list[str] = field(default_factory=list)  # GPUs it opens IPC handles on
    tiered: bool = False  # saves are durable on node-local disk first (--stage-dir)
    deadlines: DaemonDeadlines | None = None
    # The longest it holds a POLL until a save changes phase (``Poll.wait_seconds``); 0: it
    # answers every POLL at once (an older daemon), so the trainer asks at intervals.
    poll_hold_s: float = check(lambda s: s >= 0, "a number of seconds >= 0", 0.0)


class StageReply(Body):
    """Where the trainer copies a save: its request id and extent in the pool."""

    request_id: int
    offset: int
    length: int
    phase: str
    # tiered DCP: {file name: [[start, length]] per buffer}, where the writers will put them
    placements: dict[str, list] | None = None


class StagedReply(Body):
    """Every byte of a save is staged; ``ipc_kept``: buffers whose CUDA export the daemon
    keeps open (the trainer may send the same export again)."""

    request_id: int
    phase: str
    ipc_kept: list[int] = field(default_factory=list)


class WrittenFile(Body):
    """One file a finished save wrote, as its writer committed it."""

    name: str | None  # the DCP file name; None for a torch file or a local part
    path: str
    size: int
    crc32: int = 0  # the file's checksum, by ``algorithm``
    algorithm: str = "crc32"  # of that checksum record (crc32, or crc32c where computed so)
    items: list | None = None  # [offset in the file, length] of each buffer
    file_id: list | None = None  # [st_dev, st_ino]
    timing: dict | None = None  # {writer, started_at, synced_at, ended_at}: the trace's spans


class RequestState(Body):
    """What ``poll`` says about one request; phase ``unknown`` when the daemon lost it."""

    phase: str
    bytes_total: int = 0
    bytes_written: int = 0
    error: str | None = None
    errors: list = field(default_factory=list)  # {rank, path, errno, message[, code]} each
    transport_bytes: dict = field(default_factory=dict)  # {"shm": n, "cuda": n}
    written: list[WrittenFile] = field(default_factory=list)  # once done
    replication: dict | None = None  # local parts: {wanted, reduced_redundancy, holders}
    stale_of: str | None = None  # done: the previous save whose bytes this one repeats
    flush: dict | None = None  # tiered, while flushing: {attempt, next_retry_at, bytes_done...}


class PollReply(Body):
    """The state of each request asked about, by request id."""

    requests: dict[int, RequestState]


class ForgetReply(Body):
    """The requests the daemon dropped."""

    forgotten: list[int]


class AbortReply(Body):
    """The in-flight requests the daemon aborted."""

    aborted: list[int]


class CommitFileReply(Body):
    """The small file is durable."""

    path: str
    size: int


class HandoverReply(Body):
    """A tiered daemon took a DCP checkpoint's commit: it writes ``path`` once the
    ``files`` files it waits for are durable at the target."""

    path: str
    files: int


class PingReply(Body):
    """The daemon is alive."""

    pid: int


class PeerInfoReply(Body):
    """This daemon's peer addresses and key (``None`` without ``--peer-listen``) and where
    it runs (a loopback address is reachable only from the same host and network
    namespace)."""

    address: str | None
    public_key: str | None
    bulk_address: str | None
    encryption: str | None
    local_dir: str | None
    host: str
    network: str
    pid: int


class LocalSessionReply(Body):
    """The registered session's directory, and this daemon's peer address."""

    directory: str
    address: str | None


class HeldPart(Body):
    """One local-checkpoint part a daemon holds, as it verified it."""

    iteration: int
    owner: int
    size: int
    verified: bool | None
    committed: bool
    path: str
    identity: list | None = None  # [size, mtime_ns, inode] of the file as verified
    resident: dict | None = None  # where the part is in the pool, while kept in memory


class LocalInventoryReply(Body):
    """The parts a daemon holds for a session."""

    address: str | None
    host: str
    parts: list[HeldPart]


class LocalFetchReply(Body):
    """A missing part arrived from a holder."""

    path: str
    holder: str
    tried: list  # {holder, error} of each holder tried before
    moved_aside: str | None = None  # where a corrupted copy here was set aside
    identity: list | None = None


class LocalCommitReply(Body):
    """An iteration is committed; the older ones were removed."""

    removed: list[int]


class TraceSpansReply(Body):
    """Whether the daemon kept a trainer's spans (it knows the requests they belong to)."""

    kept: bool


#: Which body answers each request type. ``dict``: a map with a schema of its own (the
#: status document, the Chrome trace document), passed on unchecked.
REPLIES: dict[str, type] = {
    MessageType.HELLO: HelloReply,
    MessageType.GOODBYE: Empty,
    MessageType.PING: PingReply,
    MessageType.STATUS: dict,
    MessageType.TRACE: dict,  # a Chrome trace-event document (``ckptd trace``)
    MessageType.TRACE_SPANS: TraceSpansReply,
    MessageType.STAGE: StageReply,
    MessageType.STAGED: StagedReply,
    MessageType.COPIED: Empty,
    MessageType.POLL: PollReply,
    MessageType.FORGET: ForgetReply,
    MessageType.ABORT: AbortReply,
    MessageType.COMMIT_FILE: CommitFileReply,
    MessageType.HANDOVER: HandoverReply,
    MessageType.PEER_INFO: PeerInfoReply,
    MessageType.LOCAL_SESSION: LocalSessionReply,
    MessageType.LOCAL_INVENTORY: LocalInventoryReply,
    MessageType.LOCAL_FETCH: LocalFetchReply,
    MessageType.LOCAL_COMMIT: LocalCommitReply,
}


def reply_type_for(message_type: str) -> type:
    """The body that answers ``message_type`` (``dict`` for the status document).

    Raises
    ------
    KeyError
        If the request type has no declared reply: every request gets one.
    """
    try:
        return REPLIES[message_type]
    except KeyError:
        raise KeyError(f"no reply body is declared for {message_type!r} requests; add one "
                       "to ckptd.protocol.replies.REPLIES") from None
