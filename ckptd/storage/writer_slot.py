"""One writer process as the daemon holds it: its PAIR socket, its process, its jobs.

Owns a single writer's lifetime: the socket bound for it (:meth:`WriterSlot.bind`), the
process started on it (:meth:`WriterSlot.spawn`, in its own session so a signal to the
daemon's group never kills a writer mid-file), and its shutdown (:meth:`WriterSlot.stop`:
asked, then killed, then its temporaries swept). Which writer gets which job is
:class:`ckptd.storage.writer_pool.WriterPool`'s.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace

import zmq

from ckptd import knobs, protocol
from ckptd.storage.durable import remove_quietly
from ckptd.storage.jobs import CancelJob, StagedThrough, StartJob, StopWriter
from ckptd.storage.leftovers import WrittenDirectories, sweep_temporaries

log = logging.getLogger(__name__)


@dataclass
class WriterSlot:
    """One writer: its endpoint and socket, its process, and the jobs sent to it."""

    index: int
    endpoint: str
    socket: zmq.Socket
    process: subprocess.Popen | None = None
    ready: bool = False
    jobs: dict = field(default_factory=dict)
    #: When it last said anything, or was given work while idle: a writer with jobs that
    #: stays silent past the stall timeout is stuck on the first of them.
    last_heard: float = field(default_factory=time.monotonic)

    @classmethod
    def bind(cls, context: zmq.Context, runtime_dir: str, index: int,
             generation: int) -> WriterSlot:
        """A slot with a fresh socket bound (a replacement writer gets a fresh endpoint)."""
        endpoint = (f"ipc://{runtime_dir}/writer-{os.getpid()}-{index}"
                    f"{f'-{generation}' if generation else ''}.sock")
        sock = context.socket(zmq.PAIR)
        sock.linger = 0
        # No message to a live writer is ever dropped: a lost "all staged" would leave a
        # job started early waiting until its save's deadline (a writer reads its channel
        # only between writes; a copy reported in many small steps outruns it).
        sock.sndhwm = 0
        sock.bind(endpoint)
        return cls(index, endpoint, sock)

    def spawn(self, pool_path: str, pool_size: int, log_level: str,
              journal: WrittenDirectories | None) -> None:
        """Start the writer process on this slot's endpoint."""
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ckptd.storage.writer_process", "--endpoint", self.endpoint,
             "--parent-pid", str(os.getpid()), "--pool", pool_path, "--pool-size", str(pool_size),
             "--log-level", log_level, "--nice", str(knobs.WRITER_NICE.get()),
             "--sched", knobs.WRITER_SCHED.get(), "--io-class", knobs.WRITER_IO_CLASS.get()],
            # Own session: a Ctrl-C or SIGTERM sent to the daemon's process group must not
            # kill a writer mid-file; the daemon decides when writers stop.
            stdin=subprocess.DEVNULL, start_new_session=True)
        if journal is not None:
            journal.note_process(self.process.pid)
        self.ready = False

    @property
    def load(self) -> int:
        """Jobs it works on or will: those sent ahead and not started only wait there."""
        return sum(1 for job in self.jobs.values() if not job.held)

    def describe(self) -> dict:
        """Its state for status (``phases``: of its jobs, in the order it runs them)."""
        return {"index": self.index, "pid": self.process.pid if self.process else None,
                "alive": self.alive, "jobs": len(self.jobs),
                "phases": [job.phase for job in self.jobs.values()]}

    @property
    def alive(self) -> bool:
        """Whether its process runs."""
        return bool(self.process and self.process.poll() is None)

    def ask_to_stop(self) -> None:
        """Tell the writer to exit once its current job is done."""
        try:
            self.socket.send_multipart(
                protocol.encode(StopWriter.message_type, 0, StopWriter().to_wire()),
                flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def wait_ready(self, deadline: float, timeout: float, handle) -> None:
        """Block until the writer says it is ready (its messages go to ``handle(socket)``).

        Raises
        ------
        RuntimeError
            If it exits, or does not report by ``deadline`` (monotonic; ``timeout``: for
            the message).
        """
        while not self.ready:
            if self.process.poll() is not None:
                raise RuntimeError(f"writer process {self.index} exited with "
                                   f"{self.process.returncode} during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"writer process {self.index} did not start in {timeout:.0f}s")
            if self.socket.poll(100):
                handle(self.socket)

    def send(self, job) -> bool:
        """Send ``job`` (a WriteJob) to the writer; False if its process is gone. A held job
        goes *ahead*; so does one started before all its bytes were staged (a job that
        was waiting behind a stuck writer), which is started again at once with what is
        staged so far: a plain job would read bytes the trainer has not copied."""
        early = job.through is not None
        body = replace(job.body, ahead=True) if job.held or early else job.body
        try:
            self.socket.send_multipart(
                protocol.encode(body.message_type, job.id, body.to_wire(), job.frames),
                flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        if not self.load and not job.held:
            self.last_heard = time.monotonic()
        self.jobs[job.id] = job
        if early:
            self.start(job, b"", job.through)
        return True

    def start(self, job, skeleton: bytes = b"", through: int | None = None) -> None:
        """Tell the writer to write ``job`` (a WriteJob), sent ahead: its bytes are staged
        now (``skeleton``: a torch file's, if the job went without one), or those below
        pool offset ``through`` are (:class:`StartJob`)."""
        # The writer runs jobs in the order they become runnable, which for a held job is
        # now: last in line, so the stall check blames the job really being written.
        self.jobs[job.id] = self.jobs.pop(job.id)
        if self.load == 1:  # it was idle: its stall clock starts now
            self.last_heard = time.monotonic()
        try:
            self.socket.send_multipart(protocol.encode(
                StartJob.message_type, job.id,
                StartJob(skeleton=skeleton, through=through).to_wire()), flags=zmq.NOBLOCK)
        except zmq.Again:  # its process is gone: the job fails when it is reaped
            log.warning("writer %d did not take the start of job %d", self.index, job.id)

    def staged_through(self, job_id: int, through: int | None) -> None:
        """Tell the writer more of job ``job_id``'s bytes are staged (:class:`StagedThrough`)."""
        try:
            self.socket.send_multipart(protocol.encode(
                StagedThrough.message_type, job_id, StagedThrough(through).to_wire()),
                flags=zmq.NOBLOCK)
        except zmq.Again:  # no writer on the channel: the job fails when it is reaped
            log.warning("writer %d did not take more of job %d's bytes", self.index, job_id)

    def cancel(self, job_id: int) -> None:
        """Tell the writer to drop job ``job_id`` (its save stopped): not started, it is not
        run; running, its file is not renamed into place. The job still gets its result
        (``ECANCELED``, or ok if its rename was done already)."""
        try:
            self.socket.send_multipart(protocol.encode(CancelJob.message_type, job_id,
                                                       CancelJob().to_wire()), flags=zmq.NOBLOCK)
        except zmq.Again:  # its process is gone: the job fails when it is reaped
            log.warning("writer %d did not take the cancel of job %d", self.index, job_id)

    def stop(self, deadline: float, timeout: float) -> None:
        """Wait for the writer until ``deadline`` (monotonic), kill it if it is still there,
        sweep its temporaries and close its socket."""
        if self.process is None:
            return
        try:
            self.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.process.kill()
            try:  # a writer in an uninterruptible write dies only when it returns
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("writer pid %d did not exit after SIGKILL (stuck in the "
                            "kernel); leaving it", self.process.pid)
        for directory in {os.path.dirname(job.path) for job in self.jobs.values()}:
            sweep_temporaries(directory, self.process.pid)
        self.close()

    def close(self) -> None:
        """Close the socket and remove its endpoint file."""
        self.socket.close()
        remove_quietly(self.endpoint.removeprefix("ipc://"))
