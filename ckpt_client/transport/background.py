"""The thread that stages a connection's zero-stall saves, one after another.

Owns the queue of staging jobs (:class:`ckpt_client.transport.handover.StagingJob`) of one
connection and the thread that runs them while training goes on: each job's save hears how
it ended (``mark_staged``), a blocking save first waits for the jobs queued before it
(:meth:`BackgroundStager.wait_idle`, bounded by the daemon's staging deadlines), and a job
drops its source tensors as soon as it has run. The thread ends when its connection closes
(:meth:`BackgroundStager.stop`); a job submitted after that fails at once.
"""

from __future__ import annotations

import queue
import threading
import time

from ckpt_client.errors import DaemonRequestError, DaemonUnavailableError, StagingTimeoutError
from ckpt_client.transport import waits
from ckpt_client.transport.connection import DaemonConnection, closed_error


class BackgroundStager:
    """The thread that stages a connection's zero-stall saves, one after another."""

    def __init__(self, connection: DaemonConnection) -> None:
        self.connection = connection
        self._jobs: queue.Queue = queue.Queue()
        self._stopping = threading.Lock()  # a job is queued before the end, or not at all
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ckpt-client-stager", daemon=True)
        self._thread.start()

    def submit(self, job) -> None:
        """Queue ``job`` (a :class:`~ckpt_client.transport.handover.StagingJob`, which has
        ``run()`` and ``save``); its save's ``wait_staged`` returns (or raises) when done."""
        job.queued_at = time.monotonic()
        with self._stopping:
            if not self._stopped:
                self._jobs.put(job)
                return
        # Behind the end of the queue no thread would ever run it: the save would wait
        # for its staging (the daemon's whole staging deadline) for nothing.
        job.save.mark_staged(failure_reason(closed_error(self.connection)))

    def wait_idle(self) -> None:
        """Return once every queued job has run.

        Raises
        ------
        StagingTimeoutError
            If they did not all run within :func:`ckpt_client.transport.waits.background_staging`
            (each job's staging wait, one after another): they go on in the background.
        """
        jobs = self._jobs
        with jobs.all_tasks_done:
            queued = jobs.unfinished_tasks
            limit = waits.background_staging(self.connection.deadlines, queued)
            if not jobs.all_tasks_done.wait_for(lambda: jobs.unfinished_tasks == 0, limit):
                raise StagingTimeoutError(
                    self.connection.socket_path,
                    f"rank {self.connection.rank}: {jobs.unfinished_tasks} of the {queued} "
                    f"zero-stall save(s) queued before this one were not staged within "
                    f"{waits.as_text(limit)}, longer than the daemon's staging deadlines for them")

    def idle(self) -> bool:
        """Whether every queued job has run."""
        return self._jobs.unfinished_tasks == 0

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                self._jobs.task_done()
                return
            try:
                job.run()
            except BaseException as exc:  # reported through the save, never lost
                job.save.mark_staged(failure_reason(exc))
            else:
                job.save.mark_staged()
            finally:
                # Waiting for the next job must not keep this one's source tensors (device
                # memory on a GPU) alive until another zero-stall save comes.
                job = None
                self._jobs.task_done()

    def stop(self) -> None:
        """End the thread once the jobs queued so far have run (they fail at once on the
        closed connection); it does not wait: the connection's close may run on this
        thread. Else each reconnection would leave a thread, and its connection, behind."""
        with self._stopping:
            if self._stopped:
                return
            self._stopped = True
            self._jobs.put(None)


def failure_reason(exc: BaseException) -> str:
    """What a save's staging failure is called in its error: a daemon's refusal or absence
    as the daemon or the transport put it, anything else with its type."""
    return str(exc) if isinstance(exc, (DaemonRequestError, DaemonUnavailableError)) \
        else f"{type(exc).__name__}: {exc}"
