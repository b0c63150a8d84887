"""Starting a daemon for this node when none answers (the single-node "embedded default").

Owns the one start per node: the ranks of a node race to ``connect()``, and a lock file
beside the socket lets exactly one of them start ``ckptd serve``; the others find it
live once they hold the lock. The started daemon serves the whole node, so it sees all
of the node's GPUs, logs beside the socket, and exits when idle. Knows nothing of the
connection itself.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys

from ckptd import knobs, protocol
from ckpt_client.errors import DaemonUnavailableError

log = logging.getLogger(__name__)


def start_local_daemon(socket_path: str) -> None:
    """Start a daemon for this node unless another rank already did (file lock).

    Raises
    ------
    DaemonUnavailableError
        If the started daemon exits or is not ready in ``CKPTD_START_TIMEOUT`` seconds
        (naming its log file).
    """
    runtime_dir = os.path.dirname(socket_path)
    protocol.ensure_private_dir(runtime_dir)
    with open(os.path.join(runtime_dir, "ckptd.start.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if protocol.socket_is_live(socket_path):
            return  # another rank of this node won the race
        roots = [r for r in knobs.AUTO_ROOTS.get().split(os.pathsep) if r]
        command = [sys.executable, "-m", "ckptd", "serve", "--socket", socket_path,
                   "--pool-size", str(knobs.POOL_SIZE.get()),
                   "--exit-when-idle", str(knobs.AUTO_EXIT_WHEN_IDLE.get())]
        for root in roots:
            command += ["--root", root]
        log_path = os.path.join(runtime_dir, "ckptd.log")
        log.info("no ckptd daemon on %s; starting one (log: %s)", socket_path, log_path)
        # The daemon serves every rank of the node: it must see all of the node's GPUs,
        # not the one a launcher gave the rank that happened to start it.
        environment = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file,
                                       stderr=log_file, start_new_session=True,
                                       env=environment)
        problem = protocol.wait_until_ready(socket_path, process, knobs.START_TIMEOUT.get())
        if problem:
            raise DaemonUnavailableError(socket_path,
                                         f"the auto-started ckptd {problem} (see {log_path})")
