"""Writer processes: turn staged bytes into durable files, and the pool that runs them.

Each writer is its own process (``python -m ckptd.writers``) that maps the staging pool
read-only-in-spirit and receives jobs over a ZeroMQ PAIR socket from the daemon: one job
is one output file. A job writes to a hidden temporary name, fsyncs the file, records its
checksum beside it, renames it into place and fsyncs the directory, so a file that has
its final name is always complete. Errors come back as structured results (errno,
path), never as a dead writer.

The daemon side, :class:`WriterPool`, starts the processes, assigns each job to the
least-loaded live writer, notices a writer that died and fails its jobs, and respawns it.
This module owns file bytes on disk; it does not know about ranks or requests.
"""

from __future__ import annotations

import argparse
import ctypes
import errno as errno_mod
import logging
import mmap
import os
import subprocess
import sys
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import zmq

from ckptd import protocol
from ckptd.checksum import ChecksumWriter, sidecar_path, write_sidecar

log = logging.getLogger(__name__)

WRITE_TORCH = "write_torch"
WRITE_DCP = "write_dcp"
WRITE_BYTES = "write_bytes"
READY = "writer_ready"
STOP = "stop"

TMP_MARKER = ".ckptd-tmp"
#: Writers run at a lower CPU priority than the trainers: a save that is durable a bit
#: later costs nothing, a training step slowed by serialization costs GPU time.
WRITER_NICE = 10


def temporary_name(path: str, pid: int | None = None) -> str:
    """The hidden name process ``pid`` (default: this one) writes ``path`` under.

    The pid keeps two writers that save the same path at once off each other's bytes.
    """
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid() if pid is None else pid}{TMP_MARKER}")


def _temporaries_of(path: str) -> list[str]:
    head, tail = os.path.split(path)
    prefix = f".{tail}."
    try:
        names = os.listdir(head or ".")
    except OSError:
        return []
    return [os.path.join(head, n) for n in names if n.startswith(prefix) and n.endswith(TMP_MARKER)]


def fsync_directory(path: str) -> None:
    """Make a rename or unlink inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: Chunks at least this large are checksummed on a helper thread while they are written
#: (zlib.crc32 and file writes both release the GIL), so the checksum costs no time.
OVERLAP_MIN_BYTES = 1 << 20
#: Start writeback every this many bytes, so the final fsync has little left to do.
WRITEBACK_EVERY_BYTES = 64 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return function


_sync_file_range = _load_sync_file_range()
_crc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptd-crc")


class DurableFileStream(ChecksumWriter):
    """The stream a writer serializes into: checksums large chunks on a helper thread
    while the kernel copies them, and starts writeback early (``sync_file_range``)."""

    def __init__(self, raw) -> None:
        super().__init__(raw)
        self._fd = raw.fileno()
        self._written_back = 0

    def write(self, data) -> int:
        """Write all of ``data``; the checksum is computed alongside the write."""
        view = memoryview(data).cast("B")
        if view.nbytes < OVERLAP_MIN_BYTES:
            done = super().write(view)
        else:
            checksum = _crc_thread.submit(zlib.crc32, view, self.crc)
            try:
                done = self._write_all(view)
            finally:
                self.crc = checksum.result()
        self._start_writeback()
        return done

    def _start_writeback(self) -> None:
        pending = self.size - self._written_back
        if _sync_file_range is not None and pending >= WRITEBACK_EVERY_BYTES:
            _sync_file_range(self._fd, self._written_back, pending, _SYNC_FILE_RANGE_WRITE)
            self._written_back = self.size


def write_file_atomically(path: str, write_body: Callable[[ChecksumWriter], Any],
                          sidecar: bool = True) -> dict:
    """Write ``path`` via a temporary name; fsync, checksum, rename, fsync the directory.

    With ``sidecar=False`` the checksum is only returned, not recorded beside the file.

    Returns
    -------
    dict
        ``{"path", "size", "crc32", "file_id"}`` of the committed file; ``file_id`` is its
        ``[st_dev, st_ino]``, which tells it apart from a later file at the same path.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb", buffering=0) as raw:
            stream = DurableFileStream(raw)
            try:
                write_body(stream)
            except Exception as exc:
                if stream.error is not None and stream.error is not exc:
                    raise stream.error from exc  # keep the errno the serializer hid
                raise
            os.fsync(raw.fileno())
            stat = os.fstat(raw.fileno())
        checksum = stream.result()
        if sidecar:
            write_sidecar(path, checksum)
        os.replace(tmp, path)
        fsync_directory(directory)
    except BaseException:
        _remove_quietly(tmp)
        raise
    return {"path": path, "size": checksum.size, "crc32": checksum.value,
            "file_id": [stat.st_dev, stat.st_ino]}


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_written(path: str, file_id: list | None = None) -> None:
    """Remove a file ckptd wrote, its checksum record and any temporary leftover.

    With ``file_id`` (what :func:`write_file_atomically` returned), only that very file:
    if a later save has replaced it at ``path`` meanwhile, nothing is removed (an aborted
    save whose write finished late must not delete the next save's file).
    """
    if file_id is not None:
        try:
            stat = os.stat(path)
        except OSError:
            return
        if [stat.st_dev, stat.st_ino] != list(file_id):
            return
        for candidate in (path, sidecar_path(path)):
            _remove_quietly(candidate)
        return
    for candidate in (path, sidecar_path(path), *_temporaries_of(path)):
        _remove_quietly(candidate)


# ---------------------------------------------------------------- the writer process

class _Writer:
    """Runs inside a writer process: executes jobs against the mapped pool."""

    def __init__(self, pool_path: str, pool_size: int) -> None:
        import torch  # only writer processes pay for torch
        import torch.utils.serialization  # not imported by `import torch` alone

        # The zip records' own CRC would be a second checksum pass over every byte; the
        # crc32 sidecar already covers the whole file, and torch.load does not need it.
        torch.utils.serialization.config.save.compute_crc32 = False
        self.torch = torch
        fd = os.open(pool_path, os.O_RDWR)
        try:
            self.pool = mmap.mmap(fd, pool_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)

    def tensor_at(self, offset: int, nbytes: int, dtype: str, shape: list):
        """A tensor whose storage is exactly the pool bytes at ``offset``: no copy."""
        torch = self.torch
        torch_dtype = getattr(torch, dtype)
        if nbytes == 0:
            return torch.empty(shape, dtype=torch_dtype)
        raw = torch.frombuffer(self.pool, dtype=torch.uint8, count=nbytes, offset=offset)
        return raw.view(torch_dtype).view(shape)

    def write_torch(self, body: dict, frames: list) -> dict:
        tensors = [self.tensor_at(*spec) for spec in body["tensors"]]
        obj = protocol.fill_skeleton(protocol.unpack_value(body["skeleton"]), tensors)
        return write_file_atomically(body["path"], lambda f: self.torch.save(obj, f))

    @contextmanager
    def _zip_crc32(self, on: bool):
        """Have torch.save compute its per-record CRC32 (stock bytes) inside the block."""
        config = self.torch.utils.serialization.config.save
        before, config.compute_crc32 = config.compute_crc32, on
        try:
            yield
        finally:
            config.compute_crc32 = before

    def write_dcp(self, body: dict, frames: list) -> dict:
        placements: list = []
        stock = bool(body.get("stock"))

        def write_items(stream: ChecksumWriter) -> None:
            for offset, nbytes, dtype, shape in body["items"]:
                start = stream.tell()
                if dtype == "bytes":
                    stream.write(memoryview(self.pool)[offset:offset + nbytes])
                else:
                    self.torch.save(self.tensor_at(offset, nbytes, dtype, shape), stream)
                placements.append([start, stream.tell() - start])

        with self._zip_crc32(stock):
            result = write_file_atomically(body["path"], write_items, sidecar=not stock)
        result["items"] = placements
        return result

    def write_bytes(self, body: dict, frames: list) -> dict:
        data = frames[0] if frames else b""
        return write_file_atomically(body["path"], lambda f: f.write(data),
                                     sidecar=not body.get("stock"))

    def run(self, sock: zmq.Socket) -> None:
        handlers = {WRITE_TORCH: self.write_torch, WRITE_DCP: self.write_dcp,
                    WRITE_BYTES: self.write_bytes}
        parent = os.getppid()
        sock.send_multipart(protocol.encode(READY, 0, {"pid": os.getpid()}))
        while True:
            if not sock.poll(1000):
                if os.getppid() != parent:  # the daemon is gone: nobody wants our results
                    return
                continue
            msg = protocol.decode(sock.recv_multipart())
            if msg.type == STOP:
                return
            started = time.monotonic()
            try:
                result = {"ok": True, **handlers[msg.type](msg.body, msg.frames)}
            except OSError as exc:
                result = {"ok": False, "errno": exc.errno,
                          "error": f"{exc.strerror or exc} ({errno_mod.errorcode.get(exc.errno or 0, '?')})",
                          "path": exc.filename or msg.body.get("path")}
            except Exception as exc:  # a bad job must not kill the writer
                log.exception("writer job %s failed", msg.id)
                result = {"ok": False, "errno": None, "error": f"{type(exc).__name__}: {exc}",
                          "path": msg.body.get("path")}
            result["seconds"] = time.monotonic() - started
            sock.send_multipart(protocol.encode(protocol.MessageType.REPLY, msg.id, result))


def main(argv: list[str] | None = None) -> None:
    """Entry point of a writer process (started by :class:`WriterPool`)."""
    parser = argparse.ArgumentParser(prog="ckptd-writer")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--pool", required=True)
    parser.add_argument("--pool-size", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--nice", type=int, default=0)
    args = parser.parse_args(argv)
    if args.nice:
        os.nice(args.nice)
    logging.basicConfig(level=args.log_level, format="%(asctime)s ckptd-writer[%(process)d] %(levelname)s %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.linger = 0
    sock.connect(args.endpoint)
    try:
        _Writer(args.pool, args.pool_size).run(sock)
    finally:
        sock.close()
        ctx.term()


# ------------------------------------------------------------------ daemon side

@dataclass
class WriteJob:
    """One file to write, as the daemon tracks it."""

    kind: str
    body: dict
    on_done: Callable[["WriteJob", dict], None]
    frames: list = field(default_factory=list)
    id: int = 0


@dataclass
class _WriterSlot:
    index: int
    endpoint: str
    socket: zmq.Socket
    process: subprocess.Popen | None = None
    ready: bool = False
    jobs: dict = field(default_factory=dict)


class WriterPool:
    """Starts ``count`` writer processes and routes jobs and results.

    Parameters
    ----------
    count : int
        Number of writer processes.
    context : zmq.Context
        The daemon's context (sockets are polled by the serve loop).
    runtime_dir : str
        Private directory for the writers' ipc endpoints.
    pool_path, pool_size
        The staging pool the writers map.
    """

    def __init__(self, count: int, context: zmq.Context, runtime_dir: str,
                 pool_path: str, pool_size: int, log_level: str = "INFO",
                 nice: int = WRITER_NICE) -> None:
        self.pool_path, self.pool_size, self.log_level = pool_path, pool_size, log_level
        self.nice = nice
        self._next_job_id = 1
        self._backlog: deque[WriteJob] = deque()
        self.slots: list[_WriterSlot] = []
        for index in range(count):
            endpoint = f"ipc://{runtime_dir}/writer-{os.getpid()}-{index}.sock"
            sock = context.socket(zmq.PAIR)
            sock.linger = 0
            sock.bind(endpoint)
            self.slots.append(_WriterSlot(index, endpoint, sock))
        for slot in self.slots:
            self._spawn(slot)

    def _spawn(self, slot: _WriterSlot) -> None:
        slot.process = subprocess.Popen(
            [sys.executable, "-m", "ckptd.writers", "--endpoint", slot.endpoint,
             "--pool", self.pool_path, "--pool-size", str(self.pool_size),
             "--log-level", self.log_level, "--nice", str(self.nice)],
            # Own session: a Ctrl-C or SIGTERM sent to the daemon's process group must not
            # kill a writer mid-file; the daemon decides when writers stop.
            stdin=subprocess.DEVNULL, start_new_session=True)
        slot.ready = False

    @property
    def sockets(self) -> list[zmq.Socket]:
        """Sockets the serve loop polls for results."""
        return [slot.socket for slot in self.slots]

    def wait_ready(self, timeout: float) -> None:
        """Block until every writer has mapped the pool and said so.

        Raises
        ------
        RuntimeError
            If a writer exits or does not report within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            while not slot.ready:
                if slot.process.poll() is not None:
                    raise RuntimeError(f"writer process {slot.index} exited with "
                                       f"{slot.process.returncode} during start-up")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"writer process {slot.index} did not start in {timeout:.0f}s")
                if slot.socket.poll(100):
                    self.handle(slot.socket)

    def submit(self, job: WriteJob) -> None:
        """Queue ``job`` for the live writer with the fewest jobs in flight.

        Never blocks: with no writer ready (all restarting), jobs wait in a backlog that
        is sent when a writer reports ready.
        """
        job.id = self._next_job_id
        self._next_job_id += 1
        self._backlog.append(job)
        self._dispatch()

    def _dispatch(self) -> None:
        while self._backlog:
            ready = [s for s in self.slots if s.ready and s.process and s.process.poll() is None]
            if not ready:
                return
            slot = min(ready, key=lambda s: len(s.jobs))
            job = self._backlog[0]
            try:
                slot.socket.send_multipart(protocol.encode(job.kind, job.id, job.body, job.frames),
                                           flags=zmq.NOBLOCK)
            except zmq.Again:  # its process went away after saying ready
                slot.ready = False
                continue
            self._backlog.popleft()
            slot.jobs[job.id] = job

    def handle(self, sock: zmq.Socket) -> None:
        """Read one message from a writer's socket and complete its job."""
        slot = next(s for s in self.slots if s.socket is sock)
        msg = protocol.decode(sock.recv_multipart())
        if msg.type == READY:
            slot.ready = True
            self._dispatch()
            return
        job = slot.jobs.pop(msg.id, None)
        if job is not None:
            job.on_done(job, msg.body)

    def reap_dead(self) -> None:
        """Fail the jobs of writers that died, clean their leftovers, start new ones."""
        for slot in self.slots:
            if slot.process is None or slot.process.poll() is None:
                continue
            code, dead_pid = slot.process.returncode, slot.process.pid
            log.error("writer process %d (pid %d) died with %s; failing %d job(s) and restarting it",
                      slot.index, slot.process.pid, code, len(slot.jobs))
            jobs, slot.jobs = slot.jobs, {}
            self._spawn(slot)
            for job in jobs.values():
                _remove_quietly(temporary_name(job.body["path"], dead_pid))
                job.on_done(job, {"ok": False, "errno": None, "path": job.body["path"],
                                  "error": f"writer process died (exit status {code})"})

    @property
    def jobs_in_flight(self) -> int:
        """Jobs sent and not yet answered."""
        return len(self._backlog) + sum(len(s.jobs) for s in self.slots)

    def describe(self) -> list[dict]:
        """Per-writer state for status."""
        return [{"index": s.index, "pid": s.process.pid if s.process else None,
                 "alive": bool(s.process and s.process.poll() is None),
                 "jobs": len(s.jobs)} for s in self.slots]

    def stop(self, timeout: float = 5.0) -> None:
        """Ask writers to exit; kill those that do not, and remove their leftovers."""
        for slot in self.slots:
            try:
                slot.socket.send_multipart(protocol.encode(STOP, 0), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + timeout
        for slot in self.slots:
            if slot.process is None:
                continue
            try:
                slot.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                slot.process.kill()
                slot.process.wait()
            for job in slot.jobs.values():
                _remove_quietly(temporary_name(job.body["path"], slot.process.pid))
            slot.socket.close()
            _remove_quietly(slot.endpoint.removeprefix("ipc://"))


if __name__ == "__main__":
    main()
