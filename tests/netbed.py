"""A test bed of separate "nodes" on one machine: network namespaces, a bridge, tmpfs.

Owns the whole life of a bed: creating N node namespaces, each with its own tmpfs for
node-local data and a veth link to a Linux bridge that lives in a namespace of its own
(nothing is created in the root namespace; the subnet has no route out), optional
``tc tbf`` rate limits on both ends of every link, processes started inside the nodes,
and removing all of it again. It must not know anything about ckptd: tests and benchmarks
put daemons and ranks into the nodes with :meth:`NetBed.popen`.

Pattern: a ledger written before anything is created, and teardown by name. Every name
derives from one short random token (``netbed-<token>-n<i>``), the ledger
(``<state dir>/netbed-<token>.json``) names the owning process, so teardown runs the same
on every exit path (the ``with`` block, exceptions, Ctrl-C, SIGTERM/SIGHUP, atexit) and a
later :func:`down` (or the next bed) removes what a SIGKILLed owner left behind.

Where namespaces cannot be made (not root, no ``ip``), the bed falls back to loopback
addresses and plain directories; :attr:`NetBed.mode` and :attr:`NetBed.mode_reason` say
which mode is in use and why, for tests to print or to skip with.

Command line (from the repository root)::

    python tests/netbed.py up 2 --rate 2gbit   # prints the bed as JSON and leaves it up
    python tests/netbed.py list
    python tests/netbed.py down [NAME ...]     # default: beds made by `up` and beds of
                                               # crashed runs; --all: every bed
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

#: Every bed's name starts with this; ``down`` recognises beds by it.
NAME_PREFIX = "netbed-"
_NAME_RE = re.compile(r"^netbed-[0-9a-f]{6}$")
_NS_RE = re.compile(r"^(netbed-[0-9a-f]{6})-(?:br|n\d+)$")
#: Node i of a bed has 10.77.<octet>.<i+1>/24 (the octet differs between live beds).
SUBNET_PREFIX = "10.77"
#: Loopback fallback: node i has 127.77.<octet>.<i+1> (all of 127/8 is loopback on Linux).
LOOPBACK_PREFIX = "127.77"
MAX_NODES = 250
#: tbf: the bucket holds this much time at the configured rate, and at least a few full
#: frames (a bucket smaller than one frame would never let a packet through).
BURST_SECONDS = 0.004
MIN_BURST_BYTES = 3 * 1514
TBF_LATENCY = "50ms"
#: Ports handed out by :meth:`NetBed.free_port` in a node namespace: below the ephemeral
#: range, and nothing else listens in a namespace that was just made.
FIRST_NODE_PORT = 20000
#: Seconds processes get between SIGTERM and SIGKILL at teardown.
TERM_GRACE = 3.0
KILL_TIMEOUT = 10.0

_RATE_UNITS = {
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}
_SIZE_RE = re.compile(r"^\d+[kmgKMG%]?$")


class NetBedError(RuntimeError):
    """Creating, using or removing a bed failed; the message names the command and why."""


class NetBedUnsupported(NetBedError):
    """The operation needs network namespaces and this bed runs in loopback mode."""


def state_dir() -> str:
    """Where beds keep their ledgers and node directories (``NETBED_DIR`` overrides).

    Root uses ``/run/netbed``: like the namespaces in ``/run/netns`` it does not outlive
    a reboot on most systems, so ledger and namespaces disappear together.
    """
    if os.environ.get("NETBED_DIR"):
        return os.environ["NETBED_DIR"]
    if os.geteuid() == 0 and os.path.isdir("/run"):
        return "/run/netbed"
    return os.path.join(tempfile.gettempdir(), f"netbed-{os.getuid()}")


def parse_rate(rate: str) -> float:
    """A ``tc`` rate (``"2gbit"``, ``"100mbit"``, ``"1gbps"``, ``"500000"``) in bits/s.

    Parameters
    ----------
    rate : str
        As ``tc`` spells rates: ``bit``/``kbit``/... are bits, ``bps``/``kbps``/... bytes
        per second, ``ki``/``mi``/``gi`` prefixes are powers of two, a bare number is bits.

    Returns
    -------
    float
        Bits per second.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(rate))
    if not match:
        raise ValueError(f"not a rate: {rate!r} (expected e.g. '2gbit', '100mbit')")
    number, unit = float(match.group(1)), (match.group(2).lower() or "bit")
    if unit not in _RATE_UNITS or number <= 0:
        raise ValueError(f"not a rate: {rate!r} (units: {', '.join(_RATE_UNITS)})")
    return number * _RATE_UNITS[unit]


def tbf_burst_bytes(rate: str) -> int:
    """The tbf bucket for ``rate``: :data:`BURST_SECONDS` of it, at least a few frames."""
    return max(int(parse_rate(rate) / 8 * BURST_SECONDS), MIN_BURST_BYTES)


@dataclass
class Node:
    """One node of a bed.

    Attributes
    ----------
    index : int
        Position in :attr:`NetBed.nodes`.
    ip : str
        The node's address, reachable from every other node of the bed.
    ifname : str
        The node's interface (give it to ``GLOO_SOCKET_IFNAME``); ``"lo"`` in loopback mode.
    local_dir : str
        The node's own directory for node-local data (a tmpfs of its own in netns mode).
    ns : str or None
        The node's network namespace (``None`` in loopback mode).
    port : str or None
        The bridge-side end of the node's link, in the bridge namespace.
    rate : str or None
        The tbf rate on both ends of the link, ``None`` when unlimited.
    """

    index: int
    ip: str
    ifname: str
    local_dir: str
    ns: str | None = None
    port: str | None = None
    rate: str | None = None


class NetBed:
    """N nodes in network namespaces joined by a bridge; a context manager.

    Parameters
    ----------
    nodes : int
        How many nodes.
    rate : str or None
        ``tc`` rate limit on both ends of every node's link (e.g. ``"2gbit"``); ``None``
        leaves the links unlimited.
    tmpfs_size : str
        Size limit of each node's tmpfs (``mount -o size=``); memory is used only as
        files are written.
    mode : {"netns", "loopback"} or None
        Force a mode. ``None`` (or the ``NETBED_MODE`` environment variable when set)
        uses namespaces where they can be made and falls back to loopback otherwise.
    persistent : bool
        Leave the bed up when this process exits (what ``netbed.py up`` does); remove
        it later with ``netbed.py down``.

    Examples
    --------
    >>> with NetBed(2, rate="2gbit") as bed:                       # doctest: +SKIP
    ...     server = bed.popen(1, ["python", "server.py", bed.nodes[1].ip])
    ...     bed.run(0, ["python", "client.py", bed.nodes[1].ip])
    """

    def __init__(self, nodes: int, rate: str | None = None, tmpfs_size: str = "2g", *,
                 mode: str | None = None, persistent: bool = False) -> None:
        if not 1 <= int(nodes) <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
        if rate is not None:
            parse_rate(rate)  # refuse a bad rate before anything is created
        if not _SIZE_RE.match(str(tmpfs_size)):
            raise ValueError(f"not a tmpfs size: {tmpfs_size!r} (e.g. '2g', '512m')")
        mode = mode or os.environ.get("NETBED_MODE") or None
        if mode not in (None, "netns", "loopback"):
            raise ValueError(f"mode must be 'netns' or 'loopback', got {mode!r}")
        self.node_count = int(nodes)
        self.rate = rate
        self.tmpfs_size = str(tmpfs_size)
        self.persistent = persistent
        self._requested_mode = mode
        #: ``"netns"`` or ``"loopback"`` once the bed is up.
        self.mode: str | None = None
        #: Why this mode: what made namespaces unavailable, or that a mode was forced.
        self.mode_reason: str = ""
        self.name: str = ""
        self.octet: int = -1
        self.nodes: list[Node] = []
        self._procs: list[subprocess.Popen] = []
        self._next_port: dict[int, int] = {}
        self._lock = threading.Lock()
        self._owner = (os.getpid(), _start_time(os.getpid()))

    # -- life cycle ------------------------------------------------------------------

    def __enter__(self) -> "NetBed":
        self.up()
        return self

    def __exit__(self, *exc_info) -> None:
        self.down()

    @property
    def bridge_ns(self) -> str | None:
        """The namespace holding the bridge (``None`` in loopback mode)."""
        return f"{self.name}-br" if self.mode == "netns" else None

    @property
    def subnet(self) -> str:
        """The bed's subnet (CIDR)."""
        prefix = SUBNET_PREFIX if self.mode == "netns" else LOOPBACK_PREFIX
        return f"{prefix}.{self.octet}.0/24"

    @property
    def dir(self) -> str:
        """The directory holding the nodes' local directories."""
        return os.path.join(state_dir(), self.name)

    def up(self) -> "NetBed":
        """Create the bed (the ``with`` statement calls this); returns ``self``."""
        if self.name:
            raise NetBedError(f"bed {self.name} was brought up before (a NetBed is used once)")
        # A bed whose owner was SIGKILLed would otherwise keep its memory and addresses.
        with contextlib.suppress(Exception):
            sweep(include_persistent=False)
        mode, reason = self._choose_mode()
        self._reserve(mode)
        _register(self)
        try:
            if mode == "netns":
                try:
                    _sh(["ip", "netns", "add", self.bridge_ns])
                except NetBedError as exc:
                    if self._requested_mode == "netns":
                        raise
                    # Root without CAP_NET_ADMIN (e.g. an unprivileged container).
                    mode, reason = "loopback", f"network namespaces cannot be made here: {exc}"
                    self.mode = mode
            self.mode_reason = reason
            self._write_ledger()
            if mode == "netns":
                self._build_netns()
            else:
                self._build_loopback()
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Remove everything of the bed: processes, namespaces, mounts, directories.

        Idempotent. Raises :class:`NetBedError` when something could not be removed, after
        trying everything else.
        """
        if not self.name:
            return
        with self._lock:
            procs, self._procs = self._procs, []
        try:
            teardown(self.name, procs)
        finally:
            _unregister(self)

    def detach(self) -> None:
        """Leave the bed up after this process exits (``netbed.py down`` removes it)."""
        self.persistent = True
        self._write_ledger()
        _unregister(self)

    @classmethod
    def attach(cls, name: str) -> "NetBed":
        """A handle on a bed made elsewhere (e.g. by ``netbed.py up``), from its ledger.

        The handle does not own the bed: it is not removed when this process exits.
        """
        ledger = _read_ledger(name)
        if ledger is None:
            raise NetBedError(f"no bed named {name!r} in {state_dir()}")
        bed = cls(ledger["nodes"], ledger.get("rate"), ledger.get("tmpfs_size", "2g"),
                  mode=ledger["mode"], persistent=True)
        bed.name, bed.octet, bed.mode = name, ledger["octet"], ledger["mode"]
        bed.mode_reason = ledger.get("mode_reason", "")
        bed.nodes = [bed._node(i) for i in range(bed.node_count)]
        return bed

    def _choose_mode(self) -> tuple[str, str]:
        if self._requested_mode == "loopback":
            return "loopback", "loopback mode was asked for (mode='loopback' or NETBED_MODE)"
        missing = None
        if os.geteuid() != 0:
            missing = (f"not root (uid {os.geteuid()}): namespaces, veth links, tc and tmpfs "
                       "mounts need CAP_NET_ADMIN and CAP_SYS_ADMIN")
        elif shutil.which("ip") is None:
            missing = "the 'ip' command (iproute2) is not installed"
        elif self.rate is not None and shutil.which("tc") is None:
            missing = f"a rate ({self.rate}) was asked for and 'tc' (iproute2) is not installed"
        elif shutil.which("mount") is None or shutil.which("umount") is None:
            missing = "'mount'/'umount' are not installed"
        if missing is None:
            return "netns", "network namespaces (root, iproute2 present)"
        if self._requested_mode == "netns":
            raise NetBedError(f"netns mode was asked for but {missing}")
        return "loopback", missing

    def _reserve(self, mode: str) -> None:
        """Pick a fresh name and subnet octet and write the ledger, under a lock."""
        os.makedirs(state_dir(), exist_ok=True)
        with _state_lock():
            ledgers = [_read_ledger(n) for n in _ledger_names()]
            used_names = set(_ledger_names()) | {n for n, _ in _namespaces()}
            used_octets = {led["octet"] for led in ledgers if led}
            free = [o for o in range(256) if o not in used_octets]
            if not free:
                raise NetBedError(f"256 beds are up already (see {state_dir()}); "
                                  "run 'python tests/netbed.py down --all'")
            while True:
                name = NAME_PREFIX + secrets.token_hex(3)
                if name not in used_names:
                    break
            self.name, self.mode = name, mode
            self.octet = secrets.choice(free)
            # The ledger exists before the first namespace does: a crash at any later
            # point leaves something `down` can find by name.
            self._write_ledger()

    def _write_ledger(self) -> None:
        ledger = {
            "name": self.name, "mode": self.mode, "mode_reason": self.mode_reason,
            "octet": self.octet, "nodes": self.node_count, "rate": self.rate,
            "tmpfs_size": self.tmpfs_size, "persistent": self.persistent,
            "owner_pid": self._owner[0], "owner_start": self._owner[1],
            "pgid_starts": {str(p.pid): _start_time(p.pid) for p in self._procs},
            "created": time.time(),
        }
        path = _ledger_path(self.name)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(ledger, f)
        os.replace(tmp, path)

    def _node(self, i: int) -> Node:
        token = self.name[len(NAME_PREFIX):]
        local_dir = os.path.join(self.dir, f"n{i}")
        if self.mode == "netns":
            return Node(i, f"{SUBNET_PREFIX}.{self.octet}.{i + 1}", f"nb{i}-{token}", local_dir,
                        ns=f"{self.name}-n{i}", port=f"p{i}-{token}", rate=self.rate)
        return Node(i, f"{LOOPBACK_PREFIX}.{self.octet}.{i + 1}", "lo", local_dir)

    def _build_netns(self) -> None:
        br, token = self.bridge_ns, self.name[len(NAME_PREFIX):]
        bridge = f"br-{token}"
        _sh(["ip", "-n", br, "link", "add", bridge, "type", "bridge"])
        _sh(["ip", "-n", br, "link", "set", bridge, "up"])
        for i in range(self.node_count):
            node = self._node(i)
            self.nodes.append(node)
            _sh(["ip", "netns", "add", node.ns])
            os.makedirs(node.local_dir, exist_ok=True)
            _sh(["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_size},mode=0755",
                 node.ns, node.local_dir])
            # Both ends are created straight in their namespaces: no interface ever
            # appears in the root namespace, not even for a moment.
            _sh(["ip", "-n", br, "link", "add", node.port, "type", "veth",
                 "peer", "name", node.ifname, "netns", node.ns])
            _sh(["ip", "-n", br, "link", "set", node.port, "master", bridge, "up"])
            _sh(["ip", "-n", node.ns, "link", "set", "lo", "up"])
            _sh(["ip", "-n", node.ns, "addr", "add", f"{node.ip}/24", "dev", node.ifname])
            _sh(["ip", "-n", node.ns, "link", "set", node.ifname, "up"])
            if self.rate is not None:
                self._apply_rate(node, self.rate)

    def _build_loopback(self) -> None:
        for i in range(self.node_count):
            node = self._node(i)
            os.makedirs(node.local_dir, exist_ok=True)
            self.nodes.append(node)

    # -- processes ---------------------------------------------------------------------

    def env(self, i: int) -> dict[str, str]:
        """Environment for any process of node ``i``.

        ``GLOO_SOCKET_IFNAME`` (and ``TP_SOCKET_IFNAME``) name the node's interface: the
        hostname resolves to 127.0.0.1 here, so gloo would otherwise bind to loopback.
        ``NETBED_IP`` and ``NETBED_LOCAL_DIR`` are the node's address and local directory.
        """
        node = self.nodes[i]
        return {"NETBED": self.name, "NETBED_NODE": str(i), "NETBED_IP": node.ip,
                "NETBED_LOCAL_DIR": node.local_dir, "GLOO_SOCKET_IFNAME": node.ifname,
                "TP_SOCKET_IFNAME": node.ifname}

    def rank_env(self, i: int, rank: int, world_size: int, master_port: int, *,
                 master: int = 0, local_rank: int | None = None) -> dict[str, str]:
        """Environment for a torch.distributed rank in node ``i`` (``init_method="env://"``).

        Parameters
        ----------
        i : int
            The node the rank runs in.
        rank, world_size : int
            The rank and the size of its group.
        master_port : int
            The rendezvous store's port, e.g. ``bed.free_port(master)``.
        master : int
            The node whose address holds the rendezvous store (rank 0 must run there).
        local_rank : int or None
            Sets ``LOCAL_RANK`` when given.
        """
        env = {**self.env(i), "MASTER_ADDR": self.nodes[master].ip,
               "MASTER_PORT": str(master_port), "RANK": str(rank),
               "WORLD_SIZE": str(world_size)}
        if local_rank is not None:
            env["LOCAL_RANK"] = str(local_rank)
        return env

    def free_port(self, i: int) -> int:
        """A TCP port free on node ``i``'s address."""
        if self.mode == "netns":
            with self._lock:
                port = self._next_port.get(i, FIRST_NODE_PORT)
                self._next_port[i] = port + 1
            return port
        with socket.socket() as s:
            s.bind((self.nodes[i].ip, 0))
            return s.getsockname()[1]

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` as it must be run to execute inside node ``i``."""
        if self.mode == "netns":
            return ["ip", "netns", "exec", self.nodes[i].ns, *map(str, argv)]
        return [str(a) for a in argv]

    def popen(self, i: int, argv: list[str], *, env: dict | None = None,
              **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside node ``i``, in a new session (its own process group).

        The bed kills the group at teardown. ``env`` is added to this process's
        environment and :meth:`env`; other keyword arguments go to ``subprocess.Popen``
        (stdin defaults to ``/dev/null``).
        """
        if not self.name or not self.nodes:
            raise NetBedError("the bed is not up")
        if kwargs.pop("start_new_session", True) is not True:
            raise ValueError("bed processes always get a session of their own")
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        full_env = {**os.environ, **self.env(i), **(env or {})}
        proc = subprocess.Popen(self.command(i, argv), env=full_env, start_new_session=True,
                                **kwargs)
        with self._lock:
            self._procs = [p for p in self._procs if p.poll() is None] + [proc]
            with contextlib.suppress(OSError):
                self._write_ledger()
        return proc

    def run(self, i: int, argv: list[str], *, timeout: float = 60.0, check: bool = True,
            input: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run a short command inside node ``i`` and return its (text) output.

        Raises ``subprocess.CalledProcessError`` when ``check`` and it fails, and
        ``subprocess.TimeoutExpired`` (after killing it) when it outlives ``timeout``.
        """
        proc = self.popen(i, argv, env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE,
                          stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, argv, out, err)
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    # -- links -------------------------------------------------------------------------

    def _need_netns(self, what: str) -> None:
        if self.mode != "netns":
            raise NetBedUnsupported(f"{what} needs network namespaces; this bed runs in "
                                    f"{self.mode} mode: {self.mode_reason}")

    def link_down(self, i: int) -> None:
        """Cut node ``i``'s link at the bridge (a pulled cable: the node keeps its address,
        packets in flight are lost, connections stall until :meth:`link_up`)."""
        self._need_netns("link_down")
        _sh(["ip", "-n", self.bridge_ns, "link", "set", self.nodes[i].port, "down"])

    def link_up(self, i: int) -> None:
        """Restore node ``i``'s link after :meth:`link_down`."""
        self._need_netns("link_up")
        _sh(["ip", "-n", self.bridge_ns, "link", "set", self.nodes[i].port, "up"])

    def set_rate(self, i: int, rate: str | None) -> None:
        """Set (or with ``None`` remove) the tbf rate limit on both ends of node ``i``'s link."""
        self._need_netns("set_rate")
        if rate is not None:
            parse_rate(rate)
        node = self.nodes[i]
        if rate is None:
            for ns, dev in ((node.ns, node.ifname), (self.bridge_ns, node.port)):
                if "tbf" in _sh(["tc", "-n", ns, "qdisc", "show", "dev", dev]):
                    _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"])
        else:
            self._apply_rate(node, rate)
        node.rate = rate

    def _apply_rate(self, node: Node, rate: str) -> None:
        bits = f"{int(parse_rate(rate))}bit"
        burst = str(tbf_burst_bytes(rate))
        # Both directions: the node's egress and the bridge's egress towards the node.
        for ns, dev in ((node.ns, node.ifname), (self.bridge_ns, node.port)):
            _sh(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", bits,
                 "burst", burst, "latency", TBF_LATENCY])

    def qdisc(self, i: int, side: str = "node") -> str:
        """``tc qdisc show`` of node ``i``'s link end: ``side`` is ``"node"`` or ``"bridge"``."""
        self._need_netns("qdisc")
        node = self.nodes[i]
        ns, dev = (node.ns, node.ifname) if side == "node" else (self.bridge_ns, node.port)
        return _sh(["tc", "-n", ns, "qdisc", "show", "dev", dev])

    def describe(self) -> dict:
        """The bed as plain data (what ``netbed.py up`` prints)."""
        return {"name": self.name, "mode": self.mode, "mode_reason": self.mode_reason,
                "subnet": self.subnet, "rate": self.rate, "bridge_ns": self.bridge_ns,
                "dir": self.dir, "nodes": [asdict(n) for n in self.nodes]}

    def __repr__(self) -> str:
        return f"NetBed({self.name or 'down'}, {self.node_count} nodes, {self.mode}, rate={self.rate})"


# -- teardown by name ----------------------------------------------------------------------

def teardown(name: str, procs: list[subprocess.Popen] = ()) -> None:
    """Remove the bed ``name`` whether or not this process made it.

    Kills the given processes' groups (SIGTERM, then SIGKILL after :data:`TERM_GRACE`),
    the groups recorded in the ledger, and whatever still runs in the bed's namespaces;
    deletes the namespaces, unmounts the tmpfs mounts, removes the directories and the
    ledger. Raises :class:`NetBedError` listing what remains, after trying everything.
    """
    if not _NAME_RE.match(name):
        raise ValueError(f"not a bed name: {name!r}")
    problems: list[str] = []
    ledger = _read_ledger(name) or {}
    groups = {p.pid for p in procs if p.poll() is None}
    for pgid, start in (ledger.get("pgid_starts") or {}).items():
        # The recorded start time guards against a reused pid of an unrelated process.
        if _start_time(int(pgid)) == start and start is not None:
            groups.add(int(pgid))
    for pgid in groups:
        _kill_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_GRACE
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(max(0.0, deadline - time.monotonic()))
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.02)
    for pgid in groups:
        _kill_group(pgid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(KILL_TIMEOUT)

    namespaces = sorted((ns for ns, bed in _namespaces() if bed == name),
                        key=lambda ns: ns.endswith("-br"))  # nodes first, the bridge last
    for ns in namespaces:
        # Processes that left their group (setsid, daemons) are still in the namespace.
        pids = _netns_pids(ns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + KILL_TIMEOUT
        while pids and time.monotonic() < deadline:
            pids = [p for p in _netns_pids(ns) if _running(p)]
            time.sleep(0.01)
        if pids:
            problems.append(f"processes {pids} in {ns} survived SIGKILL")
        try:
            _sh(["ip", "netns", "del", ns])
        except NetBedError as exc:
            problems.append(str(exc))

    bed_dir = os.path.join(state_dir(), name)
    for mount_point in sorted(_mounts_under(bed_dir), key=len, reverse=True):
        try:
            _sh(["umount", mount_point])
        except NetBedError:
            try:  # still busy (a process of another mount namespace): detach it
                _sh(["umount", "-l", mount_point])
            except NetBedError as exc:
                problems.append(str(exc))
    if _mounts_under(bed_dir):
        problems.append(f"mounts remain under {bed_dir}: not removing it")
    else:
        shutil.rmtree(bed_dir, ignore_errors=True)
        if os.path.exists(bed_dir):
            problems.append(f"could not remove {bed_dir}")
    if not problems:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_ledger_path(name))
    if problems:
        raise NetBedError(f"bed {name} not fully removed: " + "; ".join(problems))


def beds() -> list[dict]:
    """Every bed on this machine: ``name``, ``state`` (live / persistent / stale) and ledger."""
    names = set(_ledger_names()) | {bed for _, bed in _namespaces()}
    if os.path.isdir(state_dir()):
        names |= {n for n in os.listdir(state_dir()) if _NAME_RE.match(n)}
    found = []
    for name in sorted(names):
        ledger = _read_ledger(name)
        if ledger is None:
            state = "stale"  # namespaces or a directory without a ledger: a crashed teardown
        elif ledger.get("persistent"):
            state = "persistent"
        elif ledger["owner_start"] is not None and \
                _start_time(ledger["owner_pid"]) == ledger["owner_start"]:
            state = "live"
        else:
            state = "stale"
        found.append({"name": name, "state": state, "ledger": ledger})
    return found


def sweep(*, include_persistent: bool = True, include_live: bool = False) -> list[str]:
    """Tear down stale beds (owner gone), and persistent and live ones when asked.

    Returns
    -------
    list of str
        The names removed.
    """
    removed = []
    for bed in beds():
        if bed["state"] == "stale" or (bed["state"] == "persistent" and include_persistent) \
                or (bed["state"] == "live" and include_live):
            teardown(bed["name"])
            removed.append(bed["name"])
    return removed


# -- tracking live beds for the exit paths ---------------------------------------------

_LIVE: list[NetBed] = []
_LIVE_LOCK = threading.Lock()
_ATEXIT_INSTALLED = False
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
#: Our handler and the one it replaced, per signal, while beds are live.
_INSTALLED: dict[int, tuple] = {}


def _register(bed: NetBed) -> None:
    global _ATEXIT_INSTALLED
    with _LIVE_LOCK:
        _LIVE.append(bed)
        first = len(_LIVE) == 1
        if not _ATEXIT_INSTALLED:
            _ATEXIT_INSTALLED = True
            atexit.register(_teardown_live)
    if first:
        _install_signal_hooks()


def _unregister(bed: NetBed) -> None:
    with _LIVE_LOCK:
        if bed not in _LIVE:
            return
        _LIVE.remove(bed)
        last = not _LIVE
    if last:
        _remove_signal_hooks()


def _install_signal_hooks() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread; atexit still runs
    for sig in _EXIT_SIGNALS:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or sig in _INSTALLED:
            continue  # whoever ignores it keeps running; the with block cleans up
        handler = _make_handler(sig, previous)
        signal.signal(sig, handler)
        _INSTALLED[sig] = (handler, previous)


def _remove_signal_hooks() -> None:
    # Hooks only while beds are live: a Python-level SIGTERM handler left in this process
    # is inherited by every child it forks afterwards, and a fork that gets its SIGTERM
    # before the interpreter's after-fork reset loses it (the child then lives on until
    # SIGKILL: an aborted helper of another test waited out its 30 s grace that way).
    if threading.current_thread() is not threading.main_thread():
        return
    for sig, (handler, previous) in list(_INSTALLED.items()):
        if signal.getsignal(sig) is handler:  # nobody replaced ours since
            signal.signal(sig, previous)
        del _INSTALLED[sig]


def _teardown_live() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for bed in reversed(live):
        # A forked child (multiprocessing) inherits the list but does not own the beds.
        if bed._owner[0] != os.getpid() or bed.persistent:
            continue
        try:
            bed.down()
        except Exception as exc:  # keep tearing down the others
            print(f"netbed: {exc}", file=sys.stderr)


def _make_handler(sig: int, previous):
    def handler(signum, frame):
        _teardown_live()
        if callable(previous):
            previous(signum, frame)
            return
        # Die of the signal, as the process would have without us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    return handler


# -- small helpers -------------------------------------------------------------------------

def _sh(argv: list[str], timeout: float = 60.0) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetBedError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetBedError(f"{' '.join(argv)} exited {done.returncode}: "
                          f"{(done.stderr or done.stdout).strip()}")
    return done.stdout


def _state_lock():
    @contextlib.contextmanager
    def lock():
        with open(os.path.join(state_dir(), ".lock"), "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    return lock()


def _ledger_path(name: str) -> str:
    return os.path.join(state_dir(), f"{name}.json")


def _ledger_names() -> list[str]:
    try:
        entries = os.listdir(state_dir())
    except FileNotFoundError:
        return []
    return [e[:-5] for e in entries if e.endswith(".json") and _NAME_RE.match(e[:-5])]


def _read_ledger(name: str) -> dict | None:
    try:
        with open(_ledger_path(name)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _namespaces() -> list[tuple[str, str]]:
    """(namespace, bed name) for every namespace that belongs to some bed."""
    try:
        entries = os.listdir("/run/netns")
    except (FileNotFoundError, PermissionError):
        return []
    return [(e, m.group(1)) for e in entries if (m := _NS_RE.match(e))]


def _netns_pids(ns: str) -> list[int]:
    try:
        return [int(p) for p in _sh(["ip", "netns", "pids", ns]).split()]
    except NetBedError:
        return []


def _mounts_under(path: str) -> list[str]:
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = _unescape(line.split()[4])
            if point.startswith(prefix) or point == prefix[:-1]:
                found.append(point)
    return found


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks (field 22 of /proc/PID/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError, PermissionError):
        return None


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no resources; its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _group_alive(pgid: int) -> bool:
    """Whether a member of process group ``pgid`` still runs (zombies do not count: an
    orphan zombie waits for init, which need not reap promptly in a container)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


# -- command line --------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """``netbed.py up|down|list``; see the module docstring."""
    parser = argparse.ArgumentParser(prog="netbed.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a bed, print it as JSON, leave it up")
    up.add_argument("nodes", type=int)
    up.add_argument("--rate", default=None, help="tc rate per link, e.g. 2gbit (default: none)")
    up.add_argument("--tmpfs-size", default="2g")
    up.add_argument("--loopback", action="store_true", help="force the loopback fallback")
    down = sub.add_parser("down", help="remove beds (default: made by `up`, or left by a "
                                       "crashed run)")
    down.add_argument("names", nargs="*")
    down.add_argument("--all", action="store_true", help="also beds whose owner still runs")
    sub.add_parser("list", help="list beds and their state")
    args = parser.parse_args(argv)

    if args.command == "up":
        bed = NetBed(args.nodes, args.rate, args.tmpfs_size,
                     mode="loopback" if args.loopback else None, persistent=True)
        bed.up()
        bed.detach()
        print(json.dumps(bed.describe(), indent=1))
        print(f"remove it with: python {sys.argv[0]} down {bed.name}", file=sys.stderr)
        return 0
    if args.command == "list":
        for bed in beds():
            ledger = bed["ledger"] or {}
            print(f"{bed['name']}  {bed['state']:10s}  {ledger.get('mode', '?'):8s}  "
                  f"nodes={ledger.get('nodes', '?')}  rate={ledger.get('rate')}  "
                  f"owner={ledger.get('owner_pid')}")
        return 0
    failed = False
    targets = args.names or None
    try:
        if targets:
            for name in targets:
                teardown(name)
                print(f"removed {name}")
        else:
            for name in sweep(include_persistent=True, include_live=args.all):
                print(f"removed {name}")
    except NetBedError as exc:
        print(f"netbed: {exc}", file=sys.stderr)
        failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
