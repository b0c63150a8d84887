"""A writer process: turns staged bytes into one durable file per job.

Started by :class:`ckptd.storage.writer_pool.WriterPool` as
``python -m ckptd.storage.writer_process``. It maps the staging pool, tells the daemon it
is ready, then executes jobs (:mod:`ckptd.storage.jobs`) received over a ZeroMQ PAIR
socket: tensors are read in place in the pool (no copy), written in torch's file format by
:mod:`ckptd.storage.torch_format` into a :class:`ckptd.storage.durable.DurableFile` (with
O_DIRECT straight from the pool where the filesystem allows it: every large tensor's bytes
start on a 4 KiB boundary of the file, as they do in the pool), and the result (size, checksum, item
offsets, or the errno of the failure) goes back. A bad job never
kills the writer; the writer exits when its daemon is gone, since nobody wants its results
any more. A job whose save the daemon stopped meanwhile (:class:`CancelJob`, read ahead
while the job runs, :class:`~ckptd.storage.writer_channel.Inbox`) is not started, or is
stopped before its rename: a save a trainer was told failed never shows at its path. A job
sent *ahead* (while its bytes are still being staged) is made ready and parked
(:mod:`ckptd.storage.file_jobs`) until its :class:`StartJob`; other jobs run meanwhile,
and a cancel removes its temporary. A start may come while the trainer still copies: the
job then reads no buffer of the pool before the daemon says it is staged
(:class:`~ckptd.storage.jobs.StagedThrough`), and renames nothing before all are.

Must not import torch: every writer would carry ~150 MB of it for nothing, since the bytes
are already in the pool and only torch's file format is needed.
"""

from __future__ import annotations

import argparse
import ctypes
import errno as errno_mod
import logging
import os
import signal
import time
from typing import Callable

import zmq

from ckptd import knobs, protocol
from ckptd.aligned_mapping import AlignedMapping
from ckptd.checksum import ChecksumWriter
from ckptd.storage.file_jobs import FileJob, ParkedJobs, Prepared
from ckptd.storage.previous import keep_aside
from ckptd.storage.writer_channel import ALL, Inbox, ProgressReporter
from ckptd.storage.priority import yield_to_trainers
from ckptd.storage.jobs import (JOB_TYPES, RESULT, StartJob, StopWriter, WriteBytes, WriteItems,
                                WriterReady, WriteResult, WriteTorch)
from ckptd.storage.layout import file_size, item_start, storage_alignment
from ckptd.storage.torch_format import (DEFAULT_ALIGNMENT, PAGE_ALIGNMENT, RawTensor, raw_tensor,
                                        write_tensor_file)
from ckptd.storage.torch_layout import TorchLayout

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1



class Writer:
    """Executes jobs against the mapped staging pool.

    Parameters
    ----------
    pool_path, pool_size
        The daemon's staging pool.
    """

    def __init__(self, pool_path: str, pool_size: int, sock: zmq.Socket | None = None) -> None:
        self.progress = ProgressReporter(sock)
        self.parked = ParkedJobs()
        self.inbox = Inbox(sock, self.parked)
        fd = os.open(pool_path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            # huge-page-aligned: where the pool's pages are (or get folded into) huge
            # pages, a direct write pins each as one, not as 512 small ones
            self._mapping = AlignedMapping(fd, pool_size, pool_path)
        finally:
            os.close(fd)
        #: The pool's bytes (the writer lives as long as its process: never unmapped).
        self.pool = self._mapping.view
        #: The writer channel's handler table: job type -> the file it writes.
        self.handlers = {WriteTorch: self.torch_file, WriteItems: self.items_file,
                         WriteBytes: self.bytes_file}
        #: The size of the last torch file of each list of tensor specs: a job sent ahead
        #: without its skeleton allocates that much (exact while only values change).
        self._torch_sizes: dict[tuple, int] = {}

    def pool_bytes(self, offset: int, nbytes: int) -> memoryview:
        """The pool's bytes ``[offset, offset + nbytes)``, as a view: no copy."""
        if offset < 0 or nbytes < 0 or offset + nbytes > len(self.pool):
            raise ValueError(f"bytes [{offset}, {offset + nbytes}) are outside the "
                             f"{len(self.pool)}-byte staging pool")
        return memoryview(self.pool)[offset:offset + nbytes]

    def tensor_at(self, offset: int, nbytes: int, dtype: str, shape: list) -> RawTensor:
        """The tensor whose bytes are the pool's at ``offset``."""
        return raw_tensor(self.pool_bytes(offset, nbytes), dtype, shape)

    def torch_file(self, job: WriteTorch, frames: list) -> FileJob:
        """One file ``torch.load(weights_only=True)`` reads: the skeleton, pool tensors."""
        buffers = [self.pool_bytes(offset, nbytes) for offset, nbytes, _, _ in job.tensors]
        specs = [(dtype, shape, nbytes) for _, nbytes, dtype, shape in job.tensors]
        max_write = knobs.WRITEBACK_EVERY_BYTES.get()

        def complete(skeleton: bytes):
            # A save with the structure of an earlier one serializes nothing per tensor,
            # and its size is known before a byte is written: all of it is allocated at once.
            layout = TorchLayout(skeleton, specs, buffers, PAGE_ALIGNMENT)
            if len(self._torch_sizes) >= 8 and layout.specs not in self._torch_sizes:
                self._torch_sizes.clear()
            self._torch_sizes[layout.specs] = layout.size
            return layout.size, lambda f: layout.write(f, max_write, self._gate(job.tensors))

        if job.skeleton:
            size, body = complete(job.skeleton)
            return FileJob(job.path, body, direct=True, size=size)
        key = tuple((dtype, tuple(shape), nbytes) for dtype, shape, nbytes in specs)
        guess = self._torch_sizes.get(key) or sum(nbytes for _, _, nbytes in specs)
        return FileJob(job.path, None, direct=True, size=guess, complete=complete)

    def items_file(self, job: WriteItems, frames: list) -> FileJob:
        """Items one after the other; records where each one landed.

        A tensor item is one complete torch archive, as DCP's ``FileSystemWriter`` writes
        it (``torch.save(tensor, stream)``). In ckptd's own files (no zip CRCs) a large
        tensor's item starts on a 4 KiB boundary of the file (zeros before it) with its
        bytes on the next one, so they go to the disk straight from the pool; smaller
        items follow back to back (:mod:`ckptd.storage.layout` owns that rule). With
        ``stock`` the items are back to back with torch's defaults (64-byte alignment,
        zip CRC-32s), so the file is stock DCP's byte for byte.
        """
        placements: list = []
        max_write = knobs.WRITEBACK_EVERY_BYTES.get()
        items = [(self.pool_bytes(offset, nbytes) if dtype == "bytes"
                  else self.tensor_at(offset, nbytes, dtype, shape))
                 for offset, nbytes, dtype, shape in job.items]

        def write_items(stream: ChecksumWriter) -> None:
            gate = self._gate(job.items)
            for index, item in enumerate(items):
                if gate is not None:  # none of its bytes is read before they are staged
                    gate(index)
                tensor = isinstance(item, RawTensor)
                nbytes = item.data.nbytes if tensor else None
                start = item_start(stream.tell(), nbytes, job.stock)
                if start > stream.tell():  # zeros up to the page; DCP reads by offset
                    stream.write(bytes(start - stream.tell()))
                if tensor:
                    write_tensor_file(stream, item, crc32=job.stock, max_write=max_write,
                                      alignment=storage_alignment(nbytes, job.stock),
                                      record_alignment=DEFAULT_ALIGNMENT)
                else:  # in slices, so writeback starts while a large part is written
                    for offset in range(0, item.nbytes, max_write):
                        stream.write(item[offset:offset + max_write])
                placements.append([start, stream.tell() - start])

        # the layout's rule gives the file's size before a byte is written: all of it is
        # allocated at once (a direct file only)
        size = 0 if job.stock else file_size([[dtype, shape, nbytes]
                                              for _, nbytes, dtype, shape in job.items])
        return FileJob(job.path, write_items, checksum=not job.stock, direct=not job.stock,
                       size=size, extra={"items": placements})

    def bytes_file(self, job: WriteBytes, frames: list) -> FileJob:
        """The message's raw frame as a file."""
        data = frames[0] if frames else b""
        return FileJob(job.path, lambda f: f.write(data), checksum=not job.stock)

    def _gate(self, entries: list) -> Callable[[int], None] | None:
        """For the job in hand if it was started while its trainer copies: ``gate(i)``
        returns once its buffer ``i`` (``entries[i]``: ``[offset, nbytes, dtype, shape]``
        in the pool) is staged; None for any other job (nothing to wait for or compute)."""
        job_id = self.progress.job_id
        if job_id not in self.inbox.staged:
            return None
        ends = [offset + nbytes for offset, nbytes, _, _ in entries]
        return lambda index: self.inbox.wait_staged(job_id, ends[index], self.progress)

    def step(self, phase: str, bytes_done: int) -> None:
        """The job in hand moved (reported); before its rename, it waits for the rest of
        its save to be staged (if started before) and stops if the daemon dropped it
        meanwhile (the temporary is removed: the path keeps what it had)."""
        if phase == "commit":
            self.inbox.wait_staged(self.progress.job_id, ALL, self.progress)
        if phase == "commit" and self.inbox.is_cancelled(self.progress.job_id):
            raise OSError(errno_mod.ECANCELED, "the daemon dropped this save (aborted or "
                          "failed) before its file was renamed into place")
        self.progress(phase, bytes_done)

    def prepare(self, msg: protocol.Message, ahead: bool = False) -> Prepared:
        """Decode a job and make its file (``ahead``: ready, its bytes not staged yet);
        never raises: a failure is kept for the job's result."""
        prepared = Prepared(msg)
        try:
            if msg.type not in JOB_TYPES:
                raise ValueError(f"{msg.type!r} is not a writer job")
            prepared.job = JOB_TYPES[msg.type].from_wire(msg.body)
            prepared.file = self.handlers[type(prepared.job)](prepared.job, msg.frames)
            if ahead:
                prepared.file.make_ready()
        except Exception as exc:  # answered when the job runs
            prepared.error = exc
        return prepared

    def execute(self, msg: protocol.Message, prepared: Prepared | None = None,
                skeleton: bytes = b"") -> WriteResult:
        """Run one job (``prepared``: made ready ahead; ``skeleton``: a torch file's, if
        its job came without one); every failure becomes a result, never an exception."""
        path = msg.body.get("path") if isinstance(msg.body.get("path"), str) else None
        started, started_at = time.monotonic(), time.time()
        try:
            self.progress.start(msg.id)
            self.inbox.start(msg.id)
            if self.inbox.is_cancelled(msg.id):
                raise OSError(errno_mod.ECANCELED, "the daemon dropped this save (aborted or "
                              "failed) before its writer began the file", path)
            prepared = prepared or self.prepare(msg)
            if prepared.error is not None:
                raise prepared.error
            job = prepared.job
            if getattr(job, "previous", ""):  # the daemon puts it back if the save fails
                keep_aside(job.path, job.previous)
            done = prepared.file.run(skeleton, self.step)
            result = WriteResult(ok=True, path=done["path"], size=done["size"],
                                 crc32=done["crc32"], algorithm=done["algorithm"],
                                 items=done.get("items"), file_id=done["file_id"],
                                 write_mode=done["write_mode"],
                                 synced_at=done.get("synced_at", 0.0))
        except OSError as exc:
            name = errno_mod.errorcode.get(exc.errno or 0, "?")
            result = WriteResult(ok=False, errno=exc.errno, path=exc.filename or path,
                                 error=f"{exc.strerror or exc} ({name})")
        except Exception as exc:  # a bad job must not kill the writer
            log.exception("writer job %s failed", msg.id)
            result = WriteResult(ok=False, path=path, error=f"{type(exc).__name__}: {exc}")
        finally:
            if prepared is not None:
                prepared.discard()  # a file made ahead whose job failed before it ran
        return WriteResult(**{**result.to_wire(), "seconds": time.monotonic() - started,
                              "started_at": started_at})

    def start(self, msg: protocol.Message) -> WriteResult | None:
        """A job sent ahead may run now (``msg``: its :class:`StartJob`); None when it was
        dropped already (cancelled: its answer went out then). A start of a job this
        writer never held (its message came undecodable, answered without its id) fails
        it now: unanswered, the job would wait for the stall timeout, which then replaces
        this healthy writer."""
        prepared = self.parked.take(msg.id)
        if prepared is None and self.parked.answered(msg.id):
            log.debug("start of job %d, which was answered already", msg.id)
            return None
        if prepared is None:
            return WriteResult(ok=False, error=f"job {msg.id} was started, but its message "
                               "never reached this writer whole (a daemon or channel fault); "
                               "save again")
        try:
            start = StartJob.from_wire(msg.body)
        except protocol.ProtocolError as exc:
            prepared.discard()
            return WriteResult(ok=False, path=prepared.path, error=f"bad start: {exc.message}")
        if start.through is not None:  # its trainer still copies: write what is staged
            self.inbox.staged_up_to(msg.id, start.through)
        return self.execute(prepared.msg, prepared, start.skeleton)

    def drop_cancelled(self, sock: zmq.Socket) -> None:
        """Answer the jobs sent ahead whose cancel came: their temporaries go."""
        for job_id in [i for i in self.parked.ids() if i in self.inbox.cancelled]:
            prepared = self.parked.drop(job_id)
            sock.send_multipart(protocol.encode(RESULT, job_id, WriteResult(
                ok=False, errno=errno_mod.ECANCELED, path=prepared.path,
                error="the daemon dropped this save (aborted or failed) before its bytes "
                      "were staged").to_wire()))
            self.inbox.done(job_id)

    def run(self, sock: zmq.Socket) -> None:
        """Serve jobs until told to stop or the daemon is gone."""
        try:
            self._serve(sock)
        finally:
            self.parked.drop_all()  # no temporary of a job never started stays

    def _serve(self, sock: zmq.Socket) -> None:
        parent = os.getppid()
        sock.send_multipart(protocol.encode(WriterReady.message_type, 0,
                                            WriterReady(os.getpid()).to_wire()))
        self.inbox.sock = sock
        while True:
            msg = self.inbox.next(1000)
            self.drop_cancelled(sock)
            if msg is None:
                if os.getppid() != parent:  # the daemon is gone: nobody wants our results
                    return
                continue
            if isinstance(msg, protocol.ProtocolError):  # answered, never fatal
                log.error("writer got an undecodable job: %s", msg.message)
                sock.send_multipart(protocol.encode(RESULT, -1, WriteResult(
                    ok=False, error=f"undecodable job: {msg.message}").to_wire()))
                continue
            if msg.type == StopWriter.message_type:
                return
            if msg.type in JOB_TYPES and msg.body.get("ahead") is True:
                self.parked.park(msg.id, self.prepare(msg, ahead=True))
                self.drop_cancelled(sock)  # its cancel may have come while it was prepared
                continue
            result = self.start(msg) if msg.type == StartJob.message_type else self.execute(msg)
            if result is not None:
                sock.send_multipart(protocol.encode(RESULT, msg.id, result.to_wire()))
            self.inbox.done(msg.id)


def die_with(parent_pid: int) -> None:
    """Be killed when the daemon dies, even by SIGKILL, even while still starting up.

    Without this a SIGKILLed daemon leaves its writers running, reparented to init, each
    mapping the (unlinked) staging pool. ``PR_SET_PDEATHSIG`` covers every later death;
    the ``getppid`` check covers a daemon that died before we asked.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this writer may outlive its "
                    "daemon", ctypes.get_errno())
    if os.getppid() != parent_pid:
        os._exit(1)  # the daemon is already gone


def main(argv: list[str] | None = None) -> None:
    """Entry point of a writer process (started by ``WriterPool``)."""
    parser = argparse.ArgumentParser(prog="ckptd-writer")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--pool-size", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--nice", type=int, default=0)
    parser.add_argument("--sched", default="normal", help="normal, batch or idle")
    parser.add_argument("--io-class", default="none", help="best-effort:N, idle or none")
    args = parser.parse_args(argv)
    die_with(args.parent_pid)  # first: nothing below may outlive the daemon
    yield_to_trainers(args.nice, args.sched, args.io_class)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s ckptd-writer[%(process)d] %(levelname)s %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    sock.connect(args.endpoint)
    try:
        Writer(args.pool, args.pool_size, sock).run(sock)
    finally:
        sock.close()
        ctx.term()


if __name__ == "__main__":
    main()
