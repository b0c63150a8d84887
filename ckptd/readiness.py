"""Telling the world the daemon is ready (and that it is stopping).

Three signals, so every launcher has one it can wait on: a line on stdout
(``ckptd ready socket=... pid=...``), a ready file beside the socket (JSON, written
atomically, removed at exit), and ``sd_notify`` datagrams when ``NOTIFY_SOCKET`` is set
(systemd ``Type=notify``). Nothing here touches requests or sockets of the protocol.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys

from ckptd.storage.durable import write_small_file

log = logging.getLogger(__name__)

READY_LINE_PREFIX = "ckptd ready"


def sd_notify(state: str) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``) to systemd's notify socket, if there is one.

    Returns
    -------
    bool
        Whether a datagram was sent.
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode())
    except OSError as exc:
        # A stale NOTIFY_SOCKET (inherited by a daemon nobody supervises) must not stop
        # the daemon from serving or from cleaning up.
        log.warning("could not notify %s (%s): %s", os.environ.get("NOTIFY_SOCKET"), state.split()[0], exc)
        return False
    return True


def announce_ready(socket_path: str, ready_file: str, info: dict) -> None:
    """Emit all readiness signals for a daemon serving ``socket_path``."""
    write_small_file(ready_file, json.dumps({"socket": socket_path, **info}).encode(),
                     mode=0o644, operator_path=True)
    print(f"{READY_LINE_PREFIX} socket={socket_path} pid={os.getpid()}", flush=True)
    sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {socket_path}")


def announce_stopping(ready_file: str) -> None:
    """Withdraw the ready file and tell systemd we are stopping."""
    try:
        os.unlink(ready_file)
    except FileNotFoundError:
        pass
    sd_notify("STOPPING=1")
    sys.stdout.flush()
