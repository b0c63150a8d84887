"""The client channel's vocabulary: the typed body of every request a trainer sends.

Owns one :class:`~ckptd.protocol.body.Body` subclass per request type (hello, stage,
staged, poll, forget, abort, commit_file and the local-checkpoint requests) and the rules
their fields follow. The client builds these to send and the daemon checks them on
receipt, so a renamed field fails at both ends. It must not hold the handlers.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from ckptd.protocol.body import Body, check
from ckptd.protocol.errors import ProtocolError
from ckptd.protocol.names import BUFFER_DTYPES, ErrorCode, SaveFormat

__all__ = ["Hello", "Stage", "Staged", "Copied", "Poll", "Forget", "Abort", "CommitFile", "LocalSession",
           "LocalInventory", "LocalFetch", "LocalCommit", "Handover", "Trace", "TraceSpans"]


def _non_negative(value: Any) -> bool:
    return value is None or value >= 0


def _valid_buffers(entries: Any) -> bool:
    """Every entry a ``[dtype name, shape of ints >= 0, byte count >= 0]``.

    Checked for every buffer of every STAGE (thousands), in the serve loop: exact types
    (what msgpack decodes to; a bool is no count) in one loop, no call per entry."""
    dtypes = BUFFER_DTYPES
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            return False
        dtype, shape, nbytes = entry
        if type(dtype) is not str or dtype not in dtypes or type(shape) is not list \
                or type(nbytes) is not int or nbytes < 0:
            return False
        for dim in shape:
            if type(dim) is not int or dim < 0:
                return False
    return True


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
    trainer copies into shared memory itself. ``layout_of`` (torch and DCP saves, instead
    of ``buffers``): the buffers are those of this connection's earlier request of that
    id; the daemon keeps the last few such saves' layouts per connection and refuses with
    ``layout_unknown`` one it no longer keeps (the trainer then sends the buffers). A DCP
    save's ``files`` still come with it: their names change every save.
    """
    format: str = check(lambda v: v in (SaveFormat.TORCH, SaveFormat.DCP, SaveFormat.LOCAL),
                        "one of torch, dcp, local")
    path: str
    buffers: list = check(_valid_buffers,
                          "a list of [dtype name, shape list, byte count]")
    skeleton: bytes = b""
    files: list = check(_valid_files, "a list of [plain file name, [buffer indices]]", [])
    cuda: list | None = None  # per buffer: a CUDA IPC spec the daemon copies from, or None
    session: str | None = None
    iteration: int | None = check(_non_negative, "an iteration >= 0", None)
    stock_files: bool = False
    layout_of: int | None = check(_non_negative, "a request id >= 0", None)

    def check_together(self) -> None:
        """File entries name existing buffers (those of a named layout are checked once
        it is looked up); a local part names its iteration; a layout named by
        ``layout_of`` comes alone (a torch or DCP save's, with no buffers)."""
        if self.layout_of is not None:
            if self.buffers or self.cuda is not None or self.format not in (SaveFormat.TORCH,
                                                                            SaveFormat.DCP):
                raise ProtocolError(ErrorCode.BAD_REQUEST, "stage: 'layout_of' names a torch "
                                    "or DCP save's whole layout: send it without buffers or "
                                    "cuda specs")
        else:
            self.check_files()
        if self.format == SaveFormat.LOCAL and self.iteration is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stage: a local part needs 'iteration'")
        if self.cuda is not None and (len(self.cuda) != len(self.buffers) or not all(
                spec is None or isinstance(spec, dict) for spec in self.cuda)):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stage: 'cuda' needs one entry (a spec "
                                "or null) per buffer, in order")

    def check_files(self) -> None:
        """Every file entry names buffers of ``buffers`` (the daemon calls it again once
        a named layout's buffers are in).

        Raises
        ------
        ProtocolError
            BAD_REQUEST naming the first file that names a buffer beyond them.
        """
        count = len(self.buffers)
        for name, indices in self.files:
            if any(i >= count for i in indices):
                raise ProtocolError(ErrorCode.BAD_REQUEST,
                                    f"stage: file {name!r} names a buffer beyond the "
                                    f"{count} described")


class Staged(Body, message="staged"):
    """The client finished copying a request's tensors into its extent.

    ``skeleton`` (torch format): the state dict's skeleton, for a STAGE the trainer sent
    ahead of walking its state dict (with the previous save's layout and no skeleton).
    ``copied_at``: when the trainer's copy ended (``time.time()``; trainer and daemon share
    the node's clock). A trainer that does not wait for STAGED's reply has returned from
    its save by the time the daemon reads this, so the daemon dates the staging's end by
    it, not by the message's arrival.
    """

    request_id: int
    skeleton: bytes | None = None
    copied_at: float | None = None


class Copied(Body, message="copied"):
    """The trainer's copy into a request's extent is done up to ``through`` bytes from the
    extent's start: those bytes hold their final values while the rest is still copied,
    so the writers may write them (they rename nothing before STAGED). Sent without
    waiting for its (empty) reply, a few times a large save; a daemon that cannot use it
    yet (no writer job made ready, a device copy in the same request) answers and
    ignores it.

    ``skeleton``: a torch save's, on the first one, when its STAGE went ahead without it.
    """

    request_id: int
    through: int = check(lambda v: v >= 0, "a byte count >= 0")
    skeleton: bytes | None = None


#: The longest a POLL may ask to be held, whatever the daemon's own cap (an hour: a
#: bigger number is a client bug, not a wish).
POLL_WAIT_LIMIT = 3600.0


class Poll(Body, message="poll"):
    """Phase and results of some of this connection's requests.

    ``wait_seconds`` > 0 (a held poll): the trainer has seen each request in the phase
    ``seen`` names for it and is willing to wait up to that long for news. The daemon
    answers at once if any listed request is in another phase (or finished, or unknown,
    or not in ``seen``), else when one of them changes phase, or when the wait (capped
    by the daemon's ``CKPTD_POLL_HOLD_MAX``) runs out, or when the trainer says goodbye
    or the daemon stops. Without it (an older client) the answer is immediate.
    """

    request_ids: list[int] = field(default_factory=list)
    wait_seconds: float = check(lambda v: 0 <= v <= POLL_WAIT_LIMIT,
                                f"a number of seconds from 0 to {POLL_WAIT_LIMIT:g}", 0.0)
    seen: dict[int, str] = field(default_factory=dict)

    def check_together(self) -> None:
        """``seen`` names only requests the poll asks about."""
        extra = set(self.seen) - set(self.request_ids)
        if extra:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"poll: 'seen' names request(s) "
                                f"{sorted(extra)} that 'request_ids' does not list")


class Forget(Body, message="forget"):
    """Drop finished requests (and the files of failed ones)."""

    request_ids: list[int] = field(default_factory=list)
    delete_files: bool = False


class Abort(Body, message="abort"):
    """Drop in-flight requests of this connection (all of them when ``request_ids`` is None).

    ``reason`` says what made the trainer drop them (``close(abort=True)``, an early
    staging the final plan did not match, a failed copy...): the daemon logs it, so an
    operator reads the real cause, not a guess.
    """

    request_ids: list[int] | None = None
    reason: str = check(lambda r: 0 < len(r) <= 1000, "a non-empty reason of at most 1000 "
                        "characters", "the trainer gave no reason (an older ckpt_client)")
    # The trainer's copy into these requests' extents may still be running (a zero-stall
    # save dropped from another thread mid-copy): the daemon keeps the extent held until
    # a STAGED says the copy is over, or the trainer is gone, so no other save is given
    # space that a late copy still writes into.
    copying: bool = False
    # Message ids of this connection's STAGE requests whose reply the trainer stopped
    # waiting for (the daemon was stopped, or slow): it never learnt the request ids, so
    # it names the requests by the messages that asked for them, and the daemon drops
    # what they made (or make, once admitted) instead of holding the space until the
    # staging deadline. An older daemon ignores the field; ``request_ids=[]`` then
    # aborts nothing.
    stages: list[int] = check(lambda ids: all(i >= 0 for i in ids),
                              "a list of message ids >= 0", [])


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


class Handover(Body, message="handover"):
    """A tiered DCP save's commit, given to the coordinator's daemon at staging time.

    The one frame is the ``.metadata`` file's bytes; the daemon writes it at ``path`` once
    every file in ``files`` (names inside the checkpoint directory, written by any rank of
    the save) is durable at the target with its checksum record, even if every trainer is
    gone by then.
    """

    path: str
    files: list = check(lambda v: all(_plain_file_name(n) for n in v),
                        "a list of plain file names", [])
    stock_files: bool = False


class Trace(Body, message="trace"):
    """The spans of the last ``last`` saves, as Chrome trace events (``ckptd trace``)."""

    last: int = check(lambda v: 1 <= v <= 10_000, "a number of saves from 1 to 10000", 10)


def _spans(value: Any) -> bool:
    return len(value) <= 1000 and all(
        isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and len(s[0]) <= 200
        and all(isinstance(t, (int, float)) for t in s[1:]) and s[1] <= s[2] for s in value)


class TraceSpans(Body, message="trace_spans"):
    """Spans a trainer measured for the save of ``request_ids`` (its blocking time,
    planning, finalize): ``[name, start, end]`` in wall-clock seconds."""

    request_ids: list[int] = field(default_factory=list)
    spans: list = check(_spans, "at most 1000 [name, start, end] spans with start <= end", [])
