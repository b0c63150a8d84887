"""What ``ckptd serve`` can be told: the daemon's configuration, with one set of defaults.

The defaults that the client's auto-start shares (pool size, writer count, drain time)
come from :mod:`ckptd.knobs`, so the CLI, the auto-started daemon and this dataclass
cannot disagree. Importable without zmq or torch (``ckptd status`` and the CLI's option
parsing stay light).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckptd import knobs


def _default_pool_size() -> int:
    return knobs.parse_size(knobs.POOL_SIZE.get())


@dataclass
class DaemonConfig:
    """Everything ``ckptd serve`` can be told.

    Parameters
    ----------
    socket_path : str
        The client socket (``--socket``).
    roots : list of str
        Directories checkpoints may be written under (``--root``).
    """

    socket_path: str
    roots: list
    pool_size: int = field(default_factory=_default_pool_size)
    pool_dir: str = field(default_factory=knobs.POOL_DIR.get)  # tmpfs or hugetlbfs (--pool-dir)
    writers: int = field(default_factory=knobs.WRITERS.get)
    local_dir: str | None = None
    peer_listen: str | None = None
    peer_advertise: str | None = None    # host other nodes dial (default: interface address)
    peer_encryption: str = field(default_factory=knobs.PEER_ENCRYPTION.get)
    log_level: str = "INFO"
    exit_when_idle: float | None = None
    drain_timeout: float = field(default_factory=knobs.DRAIN_TIMEOUT.get)
    ready_file: str | None = None
    metrics_textfile: str | None = None  # node-exporter textfile, rewritten atomically
    metrics_listen: tuple | None = None  # (host, port), checked by metrics.parse_listen_address
    metrics_labels: dict = field(default_factory=dict)  # added to every metric sample
    writer_start_timeout: float = field(default_factory=knobs.WRITER_START_TIMEOUT.get)
    stall_timeout: float = field(default_factory=knobs.STALL_TIMEOUT.get)  # --stall-timeout
    stage_dir: str | None = None         # tiered saves: node-local first (--stage-dir)
    stage_budget: int | None = None      # bytes; None: a fraction of the free space at start
    stage_policy: str = field(default_factory=knobs.STAGE_POLICY.get)
    keep_last: int | None = None         # tiered: committed checkpoints kept per directory
