"""Finding the daemon: where its socket lives and whether it is ready.

Owns the socket path rules (argument, ``$CKPTD_SOCKET``, the runtime directory), the
ready file the daemon writes once it serves, waiting for a just-started daemon to write
it, the ``ipc://`` endpoint for a path, and the private socket directory. It must not
send messages: that is :mod:`ckptd.protocol.channel`.
"""

from __future__ import annotations

import json
import os
import socket as _socket
import stat
import time

from ckptd.protocol.errors import ProtocolError
from ckptd.protocol.names import ErrorCode

__all__ = ["SOCKET_ENV", "SOCKET_NAME", "READY_FILE_NAME", "MAX_SOCKET_PATH",
           "default_runtime_dir", "resolve_socket_path", "ready_file_for", "ready_pid",
           "wait_until_ready", "endpoint_for", "socket_is_live", "ensure_private_dir"]

SOCKET_ENV = "CKPTD_SOCKET"
SOCKET_NAME = "ckptd.sock"
READY_FILE_NAME = "ckptd.ready"
#: Longest path an ``ipc://`` endpoint may have (sun_path is 108 bytes with the NUL).
MAX_SOCKET_PATH = 107


def default_runtime_dir() -> str:
    """Directory for the socket when none is configured.

    ``$XDG_RUNTIME_DIR/ckptd`` when the session has one, else ``/tmp/ckptd-<uid>``.
    """
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return os.path.join(base, "ckptd")
    return f"/tmp/ckptd-{os.getuid()}"


def resolve_socket_path(socket: str | os.PathLike | None = None) -> str:
    """The socket path: the argument, else ``$CKPTD_SOCKET``, else the default."""
    if socket:
        return os.path.abspath(os.fspath(socket))
    from_env = os.environ.get(SOCKET_ENV)
    if from_env:
        return os.path.abspath(from_env)
    return os.path.join(default_runtime_dir(), SOCKET_NAME)


def ready_file_for(socket_path: str) -> str:
    """Where the daemon serving ``socket_path`` writes its ready file."""
    return os.path.join(os.path.dirname(socket_path), READY_FILE_NAME)


def ready_pid(socket_path: str) -> int | None:
    """The pid in the ready file of the daemon serving ``socket_path`` (None if none)."""
    try:
        with open(ready_file_for(socket_path)) as f:
            return json.load(f).get("pid")
    except (OSError, ValueError, AttributeError):
        return None


def wait_until_ready(socket_path: str, process, timeout: float) -> str | None:
    """Wait until ``process`` (a ``ckptd serve`` just started for ``socket_path``) has
    written its ready file.

    Returns
    -------
    str or None
        ``None`` once it is ready; else why not (it exited, or the time ran out), for the
        caller's own error.
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            return f"exited with status {process.returncode} before it was ready"
        if ready_pid(socket_path) == process.pid:
            return None
        if time.monotonic() > deadline:
            return f"was not ready within {timeout:.0f}s"
        time.sleep(0.05)  # the daemon writes the file atomically; nothing to be woken by


def endpoint_for(socket_path: str) -> str:
    """The ZeroMQ endpoint for a socket path, checking its length first."""
    if len(socket_path) > MAX_SOCKET_PATH:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"socket path {socket_path!r} is {len(socket_path)} bytes; unix sockets allow "
            f"{MAX_SOCKET_PATH}",
            "choose a shorter --socket / CKPTD_SOCKET path",
        )
    return f"ipc://{socket_path}"


def socket_is_live(path: str) -> bool:
    """Whether something accepts connections on the unix socket ``path``."""
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError:
        return os.path.exists(path)
    finally:
        probe.close()


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700) or check an existing one is ours and closed to others.

    Raises
    ------
    PermissionError
        If the directory belongs to another user or others can enter it.
    """
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"socket directory {path} belongs to uid {info.st_uid}, not to us ({os.getuid()}); "
            "pick another --socket path")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
