"""The writer channel's vocabulary: what the daemon asks a writer process, and its answer.

One message type per kind of file, each a typed :class:`ckptd.protocol.body.Body`: the
sender builds it and the receiver checks it on arrival (:data:`JOB_TYPES` in the writer,
:data:`REPLY_TYPES` in the daemon); framed like every other ckptd message (msgpack
header + raw frames) over a ZeroMQ PAIR socket per writer. A job names byte ranges of the
staging pool as ``[offset, nbytes, dtype, shape]`` items; ``dtype == "bytes"`` means raw
bytes. A job may be sent *ahead*, while its bytes are still being staged: the writer
prepares its file (the temporary, its space) and writes it on :class:`StartJob`. It must
not hold handlers: each end keeps its own table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd.protocol.body import Body

#: A writer's reply to a job.
RESULT = "result"


class WriteTorch(Body, message="write_torch"):
    """Write one file that ``torch.load(weights_only=True)`` reads: skeleton + tensors."""

    path: str
    skeleton: bytes
    tensors: list  # [offset, nbytes, dtype, shape] per tensor, in skeleton order
    nbytes: int
    previous: str = ""  # where to keep the file it replaces (ckptd.storage.previous)
    ahead: bool = False  # sent before its bytes are staged: prepared, written on StartJob


class WriteItems(Body, message="write_items"):
    """Write items back to back into one file: DCP ``.distcp`` files and local parts.

    Tensor items are one ``torch.save`` archive each (DCP's own layout); ``bytes`` items
    are copied raw. The result's ``items`` records each item's ``[start, length]`` in the file.
    """
    path: str
    name: str
    items: list
    nbytes: int
    stock: bool = False  # torch's zip CRCs, no checksum record (protocol.STOCK_FILES)
    previous: str = ""  # where to keep the file it replaces (ckptd.storage.previous)
    ahead: bool = False  # sent before its bytes are staged: prepared, written on StartJob


class WriteBytes(Body, message="write_bytes"):
    """Write the message's one raw frame as a file (DCP ``.metadata``)."""

    path: str
    nbytes: int = 0
    stock: bool = False
    previous: str = ""  # where to keep the file it replaces (ckptd.storage.previous)


class WriterReady(Body, message="writer_ready"):
    """A writer mapped the pool and waits for jobs."""

    pid: int


class StopWriter(Body, message="stop"):
    """Exit after the job in hand."""


class StartJob(Body, message="start"):
    """The bytes of the job sent ahead whose id this message carries are all staged now:
    write its file. ``skeleton``: a torch file's, when its job went ahead without one (the
    trainer sends it only with its STAGED or its first copy report).

    ``through``: only the pool's bytes below this offset are staged yet (the trainer still
    copies the rest): write them, wait for a :class:`StagedThrough` before writing bytes
    past it, and rename nothing into place before one says all are."""

    skeleton: bytes = b""
    through: int | None = None


class StagedThrough(Body, message="staged_through"):
    """The job started with ``through`` (whose id this message carries) may write the
    pool's bytes below this ``through`` now; None: all of them, and commit its file."""

    through: int | None = None


class CancelJob(Body, message="cancel"):
    """Drop the job whose id this message carries: its save was stopped (aborted, failed,
    past a deadline) while the job was queued at the writer or running there. A job not
    started is not run; a running one stops before its file (and checksum record) is
    renamed into place; either way its result is an ``ECANCELED`` failure. A cancel that
    comes after the rename is too late: the daemon removes that file when the result
    arrives, as for any stopped save."""


class WriteResult(Body, message=RESULT):
    """How a job ended: the committed file, or the error (with errno when the OS gave one)."""

    ok: bool
    path: str | None = None
    size: int = 0
    crc32: int = 0              # the checksum's value, whatever its algorithm
    algorithm: str = "crc32"    # of the checksum (ckptd.checksum.ALGORITHMS)
    items: list | None = None
    file_id: list | None = None  # [st_dev, st_ino]: tells it apart from a later file there
    write_mode: str = ""         # "direct", "buffered: <why>", "" for small files
    errno: int | None = None
    error: str | None = None
    seconds: float = 0.0
    started_at: float = 0.0  # wall clock: when the writer began the job
    synced_at: float = 0.0   # when the bytes were all written and making them durable began


class WriteProgress(Body, message="progress"):
    """The job in hand moved: it entered ``phase`` (``create``, ``write``, ``fsync``,
    ``commit``) or wrote more bytes. Sent at phase changes and at most every
    :data:`ckptd.knobs.WRITER_PROGRESS_INTERVAL` seconds between them, so the daemon can
    tell a slow file from one stuck in the kernel."""

    phase: str
    bytes_done: int = 0


#: Phases of a job, in order (``queued``: sent to a writer, not started by it yet;
#: ``staging``: written as far as the trainer's copy got, waiting for more of it).
JOB_PHASES = ("queued", "create", "staging", "write", "fsync", "commit")

#: Jobs a writer executes, by message type (besides them the daemon sends only
#: :class:`StartJob`, :class:`StagedThrough`, :class:`StopWriter` and :class:`CancelJob`).
JOB_TYPES = {cls.message_type: cls for cls in (WriteTorch, WriteItems, WriteBytes)}
#: What a writer may send back, by message type.
REPLY_TYPES = {cls.message_type: cls for cls in (WriterReady, WriteProgress, WriteResult)}


@dataclass
class WriteJob:
    """One file to write, as the daemon tracks it until its result arrives."""

    body: Body
    on_done: object  # Callable[[WriteJob, WriteResult], None]
    frames: list = field(default_factory=list)
    id: int = 0
    writer: int = -1  # the writer it was sent to (for the timeline)
    #: Called when the job's writer is declared stuck, with the job and the writer's pid;
    #: returns what to call once that process has really exited (its extent is free then).
    on_stuck: object = None  # Callable[[WriteJob, int], Callable[[], None]] | None
    phase: str = "queued"
    bytes_done: int = 0
    progress_at: float | None = None  # time.monotonic() of its last progress; None: not started
    #: time.monotonic() by which the whole write must be durable, progress or not (a
    #: checkpoint's commit file): such a job goes only to a writer with nothing else to
    #: do, so its deadline never counts another file's write. None: the stall check alone.
    deadline: float | None = None
    deadline_of: str = ""  # the limit that set it, for the error: "CKPTD_SAVE_DEADLINE 7200s"
    cancelled: bool = False  # its save stopped: the writer is told to drop it
    #: Sent ahead and not started yet (its bytes are still being staged): its writer has
    #: only made its file ready, so it counts neither as load nor for the stall check.
    held: bool = False
    #: Started while its trainer copies: the pool offset its bytes are staged below (None:
    #: all are, or it was not started so). Re-sent to another writer, it is started so again.
    through: int | None = None

    @property
    def path(self) -> str:
        """The file this job writes."""
        return self.body.path

    @property
    def nbytes(self) -> int:
        """Bytes this job writes (before serialization overhead)."""
        return self.body.nbytes
