"""Exceptions the trainer library raises."""

from __future__ import annotations

from torch.distributed.checkpoint import CheckpointException as _TorchCheckpointException


class CheckpointException(_TorchCheckpointException, Exception):
    """A save failed on one or more ranks; raised on every rank alike.

    A subclass of ``torch.distributed.checkpoint.CheckpointException`` (what the
    reference API raises), so ``except`` clauses written for it catch ours; unlike
    torch's, it is also an ``Exception``.

    Parameters
    ----------
    message : str
        What failed.
    failures : dict of int to str
        Failing rank -> reason (rank, file, errno where known).

    Attributes
    ----------
    failures : dict of int to str
        Failing rank -> reason (torch's holds ``(exception, traceback)`` pairs instead).
    failing_ranks : list of int
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        reasons = {int(rank): str(reason) for rank, reason in dict(failures).items()}
        super().__init__(message, reasons)  # args stay (message, failures): picklable
        self.failing_ranks = sorted(reasons)
        details = "; ".join(_with_rank(r, reasons[r]) for r in self.failing_ranks)
        self._text = f"{message} (failing ranks {self.failing_ranks}: {details})"

    @property
    def failures(self) -> dict[int, str]:
        """Failing rank -> reason."""
        return self._failures

    def __str__(self) -> str:
        return self._text


def _with_rank(rank: int, reason: str) -> str:
    prefix = f"rank {rank}: "
    return reason if str(reason).startswith(prefix) else prefix + str(reason)


class _RebuiltFromArguments:
    """Pickles as its constructor's arguments (kept in ``_arguments``), not as its message.

    These errors cross process boundaries pickled: DCP gathers a rank's exception to the
    coordinator, DCP's process executor sends it back to the trainer. An exception
    pickles as ``type(e)(*e.args)``, and ``args`` holds the composed message, which
    these constructors do not take: unpickling would fail and replace the error that
    says what to do with a ``TypeError`` about ``__init__``.
    """

    _arguments: tuple = ()

    def __reduce__(self):
        return type(self), self._arguments, self.__dict__


class DaemonUnavailableError(_RebuiltFromArguments, RuntimeError):
    """No ckptd daemon answers on the socket (or it died).

    Attributes
    ----------
    socket_path : str
        The socket that was tried.
    """

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path, self._arguments = socket_path, (socket_path, reason)
        super().__init__(
            f"{reason}. Start one with `ckptd serve --socket {socket_path} --root <checkpoint dir>`, "
            f"point CKPTD_SOCKET at the daemon's socket (the SLURM prolog exports it), or use "
            f"ckpt_client.connect(auto_start=True) for a single-node job")


class DaemonRequestError(_RebuiltFromArguments, RuntimeError):
    """The daemon refused a request (bad path, pool too small, ...).

    Attributes
    ----------
    code : str
        The protocol error code.
    hint : str
        What to do about it.
    """

    def __init__(self, body: dict) -> None:
        self.code = body.get("code")
        self.hint = body.get("hint", "")
        self.body, self._arguments = body, (body,)
        text = body.get("message", "request refused")
        super().__init__(f"{text}. {self.hint}" if self.hint else text)


class DaemonNotAnsweringError(DaemonUnavailableError):
    """A ckptd daemon runs on the socket but did not answer in time.

    Its process is alive (so starting another is the wrong advice): it is stopped
    (SIGSTOP, a debugger), hung, or too loaded to answer. A kind of
    :class:`DaemonUnavailableError`, so ``except`` clauses written for that catch it.

    Attributes
    ----------
    socket_path : str
        The daemon's socket.
    daemon_pid : int or None
        The daemon's process id, where known.
    """

    def __init__(self, socket_path: str, reason: str, daemon_pid: int | None = None) -> None:
        self.socket_path, self.daemon_pid = socket_path, daemon_pid
        self._arguments = (socket_path, reason, daemon_pid)
        process = f" (pid {daemon_pid})" if daemon_pid is not None else ""
        state = f"`grep State /proc/{daemon_pid}/status`" if daemon_pid is not None else "ps"
        RuntimeError.__init__(
            self, f"{reason}. The daemon{process} at {socket_path} is running but silent: check "
                  f"`ckptd status --socket {socket_path}`, the daemon's log, and whether it is "
                  f"stopped (SIGSTOP; {state} says 'T (stopped)': send SIGCONT) or overloaded")


class StagingTimeoutError(DaemonUnavailableError):
    """Zero-stall saves queued on a connection were not staged in time.

    Raised where a save must first wait for the earlier zero-stall saves of its
    connection (they reach the daemon in planning order) and they did not end within
    every one's staging wait: the daemon is silent, or this process's copy into the pool
    hangs. A kind of :class:`DaemonUnavailableError`, so the save that waited is handled
    like one the daemon could not take (a DCP or local save is refused on every rank);
    its ``socket_path`` names the daemon.
    """

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path, self._arguments = socket_path, (socket_path, reason)
        RuntimeError.__init__(
            self, f"{reason}: the daemon at {socket_path} is silent or this process's copy "
                  f"into its pool hangs. Check `ckptd status --socket {socket_path}` and the "
                  f"daemon's log, drop the stuck saves with close(abort=True), then save again")


class DaemonReplyError(DaemonUnavailableError):
    """The daemon answered with a reply this ``ckpt_client`` cannot read.

    A field missing, renamed or of another type: the daemon runs another ckptd version
    than the trainer (or has a bug). A kind of :class:`DaemonUnavailableError`, since no
    request to that daemon can be trusted to work.

    Attributes
    ----------
    socket_path : str
        The daemon's socket.
    """

    def __init__(self, socket_path: str, reason: str) -> None:
        self.socket_path, self._arguments = socket_path, (socket_path, reason)
        RuntimeError.__init__(
            self, f"{reason}. Run the same ckptd version for the daemon and the trainers "
                  f"(restart the daemon on {socket_path} from this environment)")
