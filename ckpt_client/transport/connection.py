"""Finding and talking to the node's daemon: one registered connection per socket.

``connect()`` resolves the socket (argument, ``$CKPTD_SOCKET``, default), says hello with
this rank's identity, and maps the daemon's staging pool once; with no daemon answering
it may start one (:mod:`ckpt_client.transport.autostart`). Every wait checks that the
daemon process is still alive, so a dead daemon becomes an error within a bounded time,
not a hang.

Every request is sent as the typed body its sender built (:mod:`ckptd.protocol.messages`),
and every reply is turned into its typed body here (:func:`read_reply`, with the type
:data:`ckptd.protocol.REPLIES` declares for the request), so the rest of the library
reads attributes the protocol declares and a reply it cannot read is one clear
:class:`DaemonReplyError`, not a ``KeyError`` somewhere later.

A connection that waited a call timeout in vain for one reply is marked "not answering"
(:mod:`ckpt_client.transport.silence`, :attr:`DaemonConnection.not_answering`): the daemon
is stopped (SIGSTOP, a debugger), hung, or dead, and asking it about every other
outstanding save would cost one call timeout each. The saves that wait on it take one
short recheck, then give up at once (:mod:`ckpt_client.transport.daemon_save`), and what
they leave for the daemon (abort, forget) is sent without waiting for a reply. Any reply
to the unanswered request or a later one clears the mark, late ones included: the channel
reports every reply it reads, and the mark is read only after the replies already
waiting on the socket (SIGCONT). New requests still go out while it is set (a new save's
STAGE, the recheck): the first one answered clears it.
The connection itself is kept, not re-established: the aborts and forgets the given-up
saves left queued on it must reach a daemon that resumes, before the next request (a new
socket drops what the old one had queued), and the daemon keeps per-connection state.
A dead daemon's connection is replaced by the next :func:`connect`, mark and all.

What other parts of the client must do when the daemon died (pay the CUDA IPC releases
it owed) is registered on the connection with :meth:`DaemonConnection.when_daemon_dies`;
this module knows nothing of CUDA."""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

import zmq

from ckptd import knobs, protocol
from ckptd.protocol import process_alive
from ckpt_client.collectives import initialized, rank_and_world
from ckpt_client.errors import (DaemonNotAnsweringError, DaemonReplyError, DaemonRequestError,
                               DaemonUnavailableError)
from ckpt_client.transport import pid_watch, pool_map, waits
from ckpt_client.transport.autostart import start_local_daemon
from ckpt_client.transport.silence import AnswerWatch, Silence

log = logging.getLogger(__name__)


def _default_rank() -> tuple[int, int]:
    if initialized() is not None:
        return rank_and_world()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class DaemonConnection:
    """A registered connection of one trainer process to its node's daemon.

    Use :func:`connect` to get one.

    Attributes
    ----------
    socket_path : str
    daemon_pid : int
    incarnation : str
        The daemon's random token for this start. Every request carries it, so a daemon
        restarted at the same socket refuses requests meant for its predecessor.
    rank : int
    has_cuda : bool
        Whether the daemon can open CUDA IPC handles.
    cuda_devices : list of str
        UUIDs of the GPUs it can open them on.
    ipc_denied : str or None
        Why the kernel refused the daemon our CUDA memory, once it did: later saves of
        this process stage their CUDA tensors through shared memory.
    """

    def __init__(self, socket_path: str, channel: protocol.Channel, hello: protocol.HelloReply,
                 rank: int) -> None:
        self.socket_path = socket_path
        self.channel = channel
        self.rank = rank
        self.daemon_pid = hello.daemon_pid
        self.incarnation = hello.incarnation
        self.daemon_version = hello.version
        self.closed = False
        self.pool_path = hello.pool_path
        self.pool_size = hello.pool_size
        self.has_cuda = hello.cuda
        #: UUIDs of the GPUs the daemon can open IPC handles on.
        self.cuda_devices = list(hello.cuda_devices)
        self.ipc_denied: str | None = None
        self.writers = hello.writers
        self.host = hello.host
        #: The daemon stages saves on node-local disk first (``--stage-dir``).
        self.tiered = hello.tiered
        #: The deadlines the daemon enforces (``None``: an older daemon did not say); every
        #: wait on it is at least as long (:mod:`ckpt_client.transport.waits`).
        self.deadlines = hello.deadlines
        #: The longest the daemon holds a POLL until a save moves on (0: it cannot).
        self.poll_hold_s = hello.poll_hold_s
        self._pool_tensor = None
        self._death_hooks: list[Callable[[DaemonConnection], None]] = []
        self._close_hooks: list[Callable[[DaemonConnection], None]] = []
        self._answers = AnswerWatch(f"rank {rank}: the ckptd daemon (pid {self.daemon_pid}) "
                                    f"at {socket_path}")
        channel.on_reply = self._answers.heard  # late answers too: the daemon answers again

    # ------------------------------------------------------------------ calls
    def ensure_daemon_alive(self) -> None:
        """Raise :class:`DaemonUnavailableError` if the daemon process is gone."""
        if process_alive(self.daemon_pid):
            return
        successor = protocol.ready_pid(self.socket_path)
        what = ("was restarted: a new daemon (pid {}) serves the socket now".format(successor)
                if successor not in (None, self.daemon_pid) else "died")
        raise DaemonUnavailableError(
            self.socket_path, f"the ckptd daemon (pid {self.daemon_pid}) serving "
                              f"{self.socket_path} {what}")

    def call(self, msg_type: str, body: protocol.Body | None = None, frames=(),
             timeout: float | None = None, quiet_limit: float | None = None):
        """Send one request and return its reply, as the body type the protocol declares
        for ``msg_type`` (:data:`ckptd.protocol.REPLIES`).

        ``body`` is the request's typed body (``None``: an empty one), built by the
        sender, so a field the protocol does not declare fails here, not at the daemon.
        ``quiet_limit``: see :meth:`reply_to`.

        Raises
        ------
        DaemonUnavailableError
            If the daemon died, was restarted, or did not answer in ``timeout`` seconds;
            also for any failure of the transport itself.
        DaemonReplyError
            If the reply is not the body the protocol declares (another ckptd version).
        DaemonRequestError
            If the daemon refused the request.
        """
        return self.reply_to(self.send(msg_type, body, frames), msg_type, timeout, quiet_limit)

    def send(self, msg_type: str, body: protocol.Body | None = None, frames=()) -> int:
        """Send one request without waiting for its reply; returns the id that
        :meth:`reply_to` reads the reply by (the reply is kept until then).

        Raises
        ------
        DaemonUnavailableError
            If this connection is closed or the transport failed.
        """
        if self.closed:
            raise closed_error(self)
        if body is not None and not isinstance(body, protocol.Body):
            raise TypeError(f"a {msg_type} request takes its typed body (ckptd.protocol's "
                            f"request bodies), not a {type(body).__name__}")
        if body is not None and body.message_type not in ("", msg_type):
            raise TypeError(f"a {type(body).__name__} body is not a {msg_type} request")
        wire = {**(body.to_wire() if body is not None else {}), "incarnation": self.incarnation}
        try:
            return self.channel.send(msg_type, wire, frames)
        except zmq.ZMQError as exc:
            raise DaemonUnavailableError(
                self.socket_path, f"talking to the ckptd daemon (pid {self.daemon_pid}) "
                                  f"failed: {exc}") from None

    def reply_to(self, msg_id: int, msg_type: str, timeout: float | None = None,
                 quiet_limit: float | None = None):
        """The reply to the ``msg_type`` request :meth:`send` sent as ``msg_id``, as its
        typed body; raises as :meth:`call` does.

        A daemon found dead, or silent for at least ``CKPTD_CALL_TIMEOUT`` (the wait after
        which a save gives up on its daemon), marks the connection not answering
        (:attr:`not_answering`) unless a later request was answered; a reply clears that
        mark, even a late one nobody waits for, if its request was not sent before the
        unanswered one. A shorter wait (a forget, a span report) that runs out fails only
        its own call: a busy daemon may answer late.

        ``quiet_limit`` (the recheck of a marked connection): give up after that many
        seconds while the mark stays; once a reply clears it (the daemon answers again,
        only slowly: say, the unanswered request, late), wait the whole ``timeout``."""
        call_timeout = knobs.CALL_TIMEOUT.get()
        timeout = call_timeout if timeout is None else timeout
        started = time.monotonic()

        def still_worth_waiting() -> None:
            self.ensure_daemon_alive()
            if quiet_limit is not None and self._answers.mark is not None \
                    and time.monotonic() - started >= quiet_limit:
                raise _Quiet

        try:
            reply = self.channel.wait(msg_id, timeout, still_worth_waiting)
        except protocol.ErrorReply as exc:
            raise DaemonRequestError(exc.body) from None
        except (protocol.ReplyTimeout, _Quiet) as exc:
            try:
                self.ensure_daemon_alive()  # a dead daemon raises here; past it, it is silent
            except DaemonUnavailableError as dead:
                self._answers.went_silent(msg_id, msg_type, timeout, dead)
                raise
            waited = quiet_limit if isinstance(exc, _Quiet) else timeout
            silent = DaemonNotAnsweringError(
                self.socket_path, f"the ckptd daemon (pid {self.daemon_pid}) did not answer "
                                  f"a {msg_type} request within {waits.as_text(waited)}",
                self.daemon_pid)
            if waited >= call_timeout:  # a shorter, best-effort wait proves nothing more
                self._answers.went_silent(msg_id, msg_type, timeout, silent)
            raise silent from None
        except DaemonUnavailableError as exc:  # the daemon died while we waited
            self._answers.went_silent(msg_id, msg_type, timeout, exc)
            raise
        except (zmq.ZMQError, protocol.ProtocolError) as exc:
            raise DaemonUnavailableError(
                self.socket_path, f"talking to the ckptd daemon (pid {self.daemon_pid}) "
                                  f"failed: {exc}") from None
        return read_reply(self.socket_path, self.daemon_pid, msg_type, reply.body)

    def tell(self, msg_type: str, body: protocol.Body) -> None:
        """Send one request and do not wait for its reply (it is discarded on arrival).

        For what a save leaves for a daemon that does not answer now (an abort, a forget):
        a daemon that resumes reads it before any later request of this connection.

        Raises
        ------
        DaemonUnavailableError
            If this connection is closed or the transport failed.
        """
        self.channel.drop(self.send(msg_type, body))

    @property
    def not_answering(self) -> Silence | None:
        """The request this connection's daemon left unanswered, while no reply to it or
        to a later request came (replies already waiting are read first, late ones
        included); ``None`` while the daemon answers."""
        if self._answers.mark is not None:  # a late reply matters only to a mark
            self._collect_replies()
        return self._answers.mark

    def claim_recheck(self) -> str | None:
        """How the caller may ask the daemon: ``None`` (not marked), ``"recheck"`` (the one
        recheck of this mark, with a short wait, :meth:`reply_to`'s ``quiet_limit``: a
        reply clears the mark) or ``"silent"`` (another caller rechecked and the daemon
        has sent nothing since, late answers included: give up without asking; a
        stopped daemon costs one short wait more, not one call timeout per save)."""
        if self._answers.mark is not None:  # a late reply matters only to a mark
            self._collect_replies()
        return self._answers.claim_recheck()

    def _collect_replies(self) -> None:
        """Read the replies waiting on the socket (late answers nobody reads otherwise)."""
        try:
            self.channel.collect()
        except (zmq.ZMQError, protocol.ProtocolError) as exc:  # the next call meets it too
            log.debug("rank %d: reading late replies failed: %s", self.rank, exc)

    def when_daemon_dies(self, hook: Callable[[DaemonConnection], None]) -> None:
        """Call ``hook(self)`` once, when this connection closes and its daemon is dead.

        What a dead daemon leaves to this process goes here: the CUDA export cache
        registers the payment of the IPC reference counters the daemon held.
        """
        self._death_hooks.append(hook)

    def when_closed(self, hook: Callable[[DaemonConnection], None]) -> None:
        """Call ``hook(self)`` when this connection closes (at once if it is closed), to drop
        state kept for it elsewhere; it may run twice (a close racing with this call)."""
        self._close_hooks.append(hook)
        if self.closed:  # close() may have taken the list before the hook joined it
            hook(self)

    # ------------------------------------------------------------------ staging pool
    @property
    def pool(self):
        """The staging pool as a flat ``torch.uint8`` tensor, mapped once (its views read
        zeros once this connection closed, when this raises DaemonUnavailableError)."""
        pool = self._pool_tensor  # read once: close() may drop it meanwhile
        if pool is None:
            if self.closed:
                raise closed_error(self)
            pool = self._pool_tensor = pool_map.map_pool(self.pool_path, self.pool_size)
        return pool

    def close(self) -> None:
        """Say goodbye and close the socket (later calls raise DaemonUnavailableError)."""
        if self.closed:
            return
        # Before GOODBYE frees unstaged saves' extents: a copy still running writes here alone.
        pool_map.retire_pool(self._pool_tensor, self.pool_path)  # not unmapped: views live on
        try:
            self.call(protocol.MessageType.GOODBYE, timeout=1.0)
        except Exception:  # the daemon may already be gone; closing must not fail
            pass
        self.closed = True
        self.channel.close()
        self._pool_tensor = None
        _uncache(self)
        pid_watch.forget(self.daemon_pid)  # no descriptor kept for a daemon nobody asks about
        for hook in list(self._close_hooks):  # once: a closed connection returns above
            hook(self)
        hooks, self._death_hooks = self._death_hooks, []
        if hooks and not process_alive(self.daemon_pid):
            for hook in hooks:
                hook(self)


def closed_error(connection: DaemonConnection) -> DaemonUnavailableError:
    """What a use of the closed ``connection`` raises."""
    return DaemonUnavailableError(
        connection.socket_path, f"this connection to the ckptd daemon (pid "
                                f"{connection.daemon_pid}) was closed: that daemon is gone or "
                                "was restarted, or this process was forked from the one that "
                                "made it; connect again")


class _Quiet(Exception):
    """A recheck's quiet limit passed while the mark stayed: nothing the daemon sent
    answered the unanswered request or a later one."""


_connections: dict[str, DaemonConnection] = {}


def _uncache(connection: DaemonConnection) -> None:
    if _connections.get(connection.socket_path) is connection:  # not a newer one connect() made
        del _connections[connection.socket_path]


def _forsake_the_parents_connections() -> None:
    """In a child just forked (a DataLoader worker, a process runner): the connections
    are the parent's, their zmq sockets and channel turns as the parent's threads left
    them (one may have held a turn, waiting on a held POLL). They are marked closed
    without touching a socket, so this process's connect() makes one of its own."""
    for connection in _connections.values():
        connection.closed = True
        connection.channel.forsake(os.getppid())
    _connections.clear()


os.register_at_fork(after_in_child=_forsake_the_parents_connections)


def read_reply(socket_path: str, daemon_pid: int | None, msg_type: str, body: dict):
    """The reply to a ``msg_type`` request as its typed body (``dict``: status document).

    Raises
    ------
    DaemonReplyError
        If a field is missing or has another type: the daemon speaks another version.
    """
    reply_type = protocol.reply_type_for(msg_type)
    if reply_type is dict:
        return body
    try:
        return reply_type.from_wire(body)
    except protocol.ProtocolError as exc:
        daemon = f"the ckptd daemon (pid {daemon_pid})" if daemon_pid else "the ckptd daemon"
        raise DaemonReplyError(socket_path, f"{daemon} on {socket_path} answered a {msg_type} "
                                            f"request with a reply this ckpt_client cannot "
                                            f"read: {exc.message}") from None


def connect(socket: str | os.PathLike | None = None, auto_start: bool | None = None,
            rank: int | None = None) -> DaemonConnection:
    """Connect this process to its node's ckptd daemon (cached per socket).

    Parameters
    ----------
    socket : str, optional
        Socket path. Default: ``$CKPTD_SOCKET``, else ``$XDG_RUNTIME_DIR/ckptd/ckptd.sock``,
        else ``/tmp/ckptd-<uid>/ckptd.sock``.
    auto_start : bool, optional
        Start a local daemon when none answers. Default: ``$CKPTD_AUTO_START`` if set,
        else on only when no socket was configured (single-node use). An auto-started
        daemon allows the roots in ``$CKPTD_ROOTS`` (``:``-separated; default ``/``),
        uses ``$CKPTD_POOL_SIZE`` (default 1G) and exits when idle for two minutes.
    rank : int, optional
        This process's rank; default from torch.distributed, else ``$RANK``.

    Returns
    -------
    DaemonConnection

    Raises
    ------
    DaemonUnavailableError
        If no daemon answers and none was started.
    """
    explicit = bool(socket) or bool(os.environ.get(protocol.SOCKET_ENV))
    socket_path = protocol.resolve_socket_path(socket)
    cached = _connections.get(socket_path)
    if cached is not None and pid_watch.alive(cached.daemon_pid):  # on every call: cheap
        return cached
    if cached is not None:
        cached.close()
    if auto_start is None:
        configured = knobs.AUTO_START.get()
        auto_start = configured if configured is not None else not explicit
    default_rank, world_size = _default_rank()
    rank = default_rank if rank is None else rank
    conn = _hello(socket_path, rank, world_size)
    if conn is None and auto_start:
        start_local_daemon(socket_path)
        conn = _hello(socket_path, rank, world_size)
    if conn is None:
        _raise_unanswered(socket_path)
    conn.pool  # map the staging pool now, so the first save does not pay for it
    _connections[socket_path] = conn
    return conn


def _raise_unanswered(socket_path: str) -> None:
    """No hello came back: say whether a daemon runs there (silent) or none does."""
    pid = protocol.ready_pid(socket_path)
    if pid is not None and process_alive(pid) and protocol.socket_is_live(socket_path):
        raise DaemonNotAnsweringError(
            socket_path, f"the ckptd daemon (pid {pid}) serving {socket_path} did not answer "
                         f"its hello within {waits.as_text(knobs.HELLO_TIMEOUT.get())}", pid)
    raise DaemonUnavailableError(socket_path, f"no ckptd daemon answers on {socket_path}")


def _hello(socket_path: str, rank: int, world_size: int) -> DaemonConnection | None:
    if not protocol.socket_is_live(socket_path):
        return None
    channel = protocol.Channel(protocol.endpoint_for(socket_path))
    try:
        reply = channel.call(protocol.MessageType.HELLO,
                             protocol.Hello(rank=rank, pid=os.getpid(),
                                            world_size=world_size).to_wire(),
                             timeout=knobs.HELLO_TIMEOUT.get())
    except protocol.ReplyTimeout:
        channel.close()
        return None
    except protocol.ErrorReply as exc:
        channel.close()
        raise DaemonRequestError(exc.body) from None
    try:
        hello = read_reply(socket_path, reply.body.get("daemon_pid"), protocol.MessageType.HELLO,
                           reply.body)
    except DaemonReplyError:
        channel.close()
        raise
    return DaemonConnection(socket_path, channel, hello, rank)
