"""The ``ckptd`` command: ``serve``, ``status``, ``trace`` and ``verify``.

Option spellings here are a contract (SLURM prologs, systemd units and scripts use
them). ``status`` and ``trace`` must stay fast: the daemon modules, and so torch, are
imported only by ``serve``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time

import click

from ckptd import __version__, knobs, protocol


def parse_size(text: str) -> int:
    """Parse ``512M``, ``2G``, ``1.5GiB`` or a plain byte count (a click error if not)."""
    try:
        return knobs.parse_size(text)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def knob_default(knob: knobs.Knob) -> str:
    """What ``--help`` shows as the default of an option a knob backs.

    The option's default is the knob's ``get`` (read when the command runs, so the
    environment applies); click would print that bound method's repr, so the text is
    given here: the built-in value and the variable that overrides it.
    """
    return f"{knob.default}, or ${knob.env}"


@click.group()
@click.version_option(__version__, prog_name="ckptd")
def main() -> None:
    """ckptd: a per-node checkpoint daemon for PyTorch training jobs."""


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="ipc socket path (default: $CKPTD_SOCKET, else "
                   "$XDG_RUNTIME_DIR/ckptd/ckptd.sock or /tmp/ckptd-<uid>/ckptd.sock).")
@click.option("--root", "roots", multiple=True, type=click.Path(),
              help="Directory checkpoints may be written under (repeatable; default: the "
                   "current directory).")
@click.option("--local-dir", type=click.Path(), default=None,
              help="Node-local directory for local checkpoints and replicas.")
@click.option("--pool-size", default=knobs.POOL_SIZE.get,
              show_default=knob_default(knobs.POOL_SIZE),
              help="Shared-memory staging pool size (e.g. 512M, 8G; env CKPTD_POOL_SIZE).")
@click.option("--pool-dir", type=click.Path(), default=knobs.POOL_DIR.get,
              show_default=knob_default(knobs.POOL_DIR),
              help="tmpfs (or hugetlbfs) directory the staging pool is made in; a tmpfs "
                   "mounted with huge=within_size makes direct writes cheaper (see "
                   "docs/operations.md).")
@click.option("--writers", type=click.IntRange(1, 64), default=knobs.WRITERS.get,
              show_default=knob_default(knobs.WRITERS), help="Number of writer processes.")
@click.option("--peer-listen", default=None,
              help="tcp address to listen for peer daemons on, e.g. tcp://10.0.0.5:7740 "
                   "(tcp://0.0.0.0:PORT: every interface, advertising an interface address).")
@click.option("--peer-advertise", default=None, metavar="HOST",
              help="Address other nodes reach this daemon at (default: the --peer-listen "
                   "host, or for 0.0.0.0 the first non-loopback interface address).")
@click.option("--peer-encryption", type=click.Choice(["aes-256-gcm", "none"]),
              default=knobs.PEER_ENCRYPTION.get, show_default=knob_default(knobs.PEER_ENCRYPTION),
              help="Protection of part bytes between daemons: AES-256-GCM, or none (bytes in "
                   "clear, still authenticated per chunk). Same on every node of a job.")
@click.option("--log-level", default="INFO", show_default=True,
              type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
@click.option("--ready-file", type=click.Path(), default=None,
              help="Where to write the ready file (default: ckptd.ready beside the socket).")
@click.option("--exit-when-idle", type=float, default=None,
              help="Exit after this many seconds with no trainers and no saves.")
@click.option("--drain-timeout", type=float, default=knobs.DRAIN_TIMEOUT.get,
              show_default=knob_default(knobs.DRAIN_TIMEOUT),
              help="On SIGTERM, seconds to let in-flight writes finish before abandoning them.")
@click.option("--stall-timeout", type=click.FloatRange(min=0, min_open=True),
              default=knobs.STALL_TIMEOUT.get, show_default=knob_default(knobs.STALL_TIMEOUT),
              metavar="SECONDS",
              help="A file write or fsync that makes no progress for this long fails its save "
                   "on every rank, naming rank, file and phase.")
@click.option("--metrics-textfile", type=click.Path(dir_okay=False), default=None,
              help="Keep Prometheus metrics in this file (node-exporter textfile collector; "
                   "rewritten atomically every few seconds).")
@click.option("--metrics-listen", default=None, metavar="HOST:PORT",
              help="Serve Prometheus metrics over HTTP on this loopback address, "
                   "e.g. 127.0.0.1:9464.")
@click.option("--metrics-allow-remote", is_flag=True,
              help="Allow a non-loopback --metrics-listen address (the endpoint has no auth).")
@click.option("--metrics-label", "metrics_labels", multiple=True, metavar="NAME=VALUE",
              help="Label added to every metric, e.g. slurm_job_id=42 (repeatable).")
@click.option("--stage-dir", type=click.Path(file_okay=False), default=None,
              help="Node-local directory (disk or tmpfs) every checkpoint-root save is made "
                   "durable in first; the daemon then flushes it to its target in the "
                   "background, and commits it there only when whole.")
@click.option("--stage-budget", default=None, metavar="SIZE",
              help="Bytes the stage directory may hold (e.g. 200G; default: 90% of its "
                   "filesystem's free space at start).")
@click.option("--stage-policy", type=click.Choice(["wait", "refuse"]),
              default=knobs.STAGE_POLICY.get, show_default=knobs.STAGE_POLICY.default,
              help="A save that does not fit the stage budget waits for flushes to free it, "
                   "or is refused at once (training goes on).")
@click.option("--keep-last", type=click.IntRange(1, None), default=None, metavar="N",
              help="With --stage-dir: keep the newest N checkpoints ckptd committed in each "
                   "directory, deleting older ones only once N newer are durable at the target.")
def serve(socket_path, roots, local_dir, pool_size, pool_dir, writers, peer_listen, peer_advertise,
          peer_encryption, log_level, ready_file, exit_when_idle, drain_timeout,
          stall_timeout, metrics_textfile, metrics_listen, metrics_allow_remote, metrics_labels,
          stage_dir, stage_budget, stage_policy, keep_last) -> None:
    """Run the daemon in the foreground until SIGTERM."""
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s ckptd[%(process)d] %(levelname)s %(name)s: %(message)s")
    from ckptd.server.config import DaemonConfig
    from ckptd.server.daemon import AlreadyRunningError, Daemon

    listen, labels = _metrics_options(metrics_listen, metrics_allow_remote, metrics_labels)
    config = DaemonConfig(
        socket_path=protocol.resolve_socket_path(socket_path),
        roots=list(roots) or [os.getcwd()], pool_size=parse_size(pool_size),
        pool_dir=os.path.abspath(pool_dir), writers=writers,
        local_dir=local_dir, peer_listen=peer_listen, peer_advertise=peer_advertise,
        peer_encryption=peer_encryption, log_level=log_level.upper(),
        exit_when_idle=exit_when_idle, drain_timeout=drain_timeout, ready_file=ready_file,
        stall_timeout=stall_timeout,
        metrics_textfile=metrics_textfile and os.path.abspath(metrics_textfile),
        metrics_listen=listen, metrics_labels=labels,
        stage_dir=stage_dir and os.path.abspath(stage_dir),
        stage_budget=parse_size(stage_budget) if stage_budget else None,
        stage_policy=stage_policy, keep_last=keep_last)
    daemon = Daemon(config)
    try:
        daemon.start()
    except (AlreadyRunningError, OSError, protocol.ProtocolError, RuntimeError) as exc:
        daemon.shutdown()
        raise click.ClickException(str(getattr(exc, "message", exc)))
    daemon.serve_forever()


def _metrics_options(listen: str | None, allow_remote: bool,
                     labels: tuple) -> tuple[tuple | None, dict]:
    """Check ``--metrics-listen`` and ``--metrics-label`` before anything starts."""
    from ckptd.metrics import RESERVED_LABELS, MetricsAddressError, parse_listen_address

    address = None
    if listen:
        try:
            address = parse_listen_address(listen, allow_remote)
        except MetricsAddressError as exc:
            raise click.BadParameter(str(exc), param_hint="--metrics-listen") from None
    parsed = {}
    for item in labels:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) or name.startswith("__"):
            raise click.BadParameter(f"{item!r} is not NAME=VALUE with a Prometheus label name",
                                     param_hint="--metrics-label")
        if name in RESERVED_LABELS:
            raise click.BadParameter(f"label {name!r} is used by ckptd's own metrics; choose "
                                     "another name", param_hint="--metrics-label")
        parsed[name] = value
    return address, parsed


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="Socket of the daemon to ask (default as for serve).")
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--watch", is_flag=True,
              help="Refresh until interrupted, with live progress and throughput.")
@click.option("--interval", type=float, default=1.0, show_default=True,
              help="Seconds between refreshes with --watch.")
@click.option("--health", is_flag=True, help="Print one summary line (for scripts).")
@click.option("--timeout", type=float, default=3.0, show_default=True,
              help="Seconds to wait for the daemon's answer.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="With --watch: stop after this many refreshes.")
def status(socket_path, as_json, watch, interval, health, timeout, count) -> None:
    """Show a daemon's ranks, requests and pool. Exit 0 running, 3 not running, 4 unknown."""
    from ckptd import status as status_mod

    path = protocol.resolve_socket_path(socket_path)
    previous = None  # the last answer: throughput needs two samples
    shown, code = 0, status_mod.EXIT_UNKNOWN
    try:
        while True:
            code, doc, why = status_mod.query_status(path, timeout)
            if watch and sys.stdout.isatty():
                click.clear()
            elif watch and shown and not as_json:
                click.echo("")
            if doc is None:
                click.echo(json.dumps({"running": False, "exit_code": code, "reason": why})
                           if as_json else why, err=not as_json)
            elif as_json:
                click.echo(status_mod.to_json(doc))
            elif health:
                click.echo(status_mod.health_line(doc))
            else:
                if watch:
                    click.echo(status_mod.progress_line(previous, doc))
                click.echo(status_mod.render(doc))
            previous, shown = doc, shown + 1
            if not watch or (count is not None and shown >= count):
                sys.exit(code)
            time.sleep(interval)  # --watch refresh period, not a synchronization
    except KeyboardInterrupt:
        sys.exit(code)



@main.command()
@click.argument("path", type=click.Path(exists=True))
def verify(path) -> None:
    """Check a checkpoint file or directory against its ckptd checksums (exit 1 on damage)."""
    from ckptd.checksum import ChecksumMismatchError, verify_tree

    try:
        checked = verify_tree(path)
    except ChecksumMismatchError as exc:
        raise click.ClickException(str(exc))
    click.echo(f"{len(checked)} file(s) verified under {path}")


@main.command()
@click.option("--socket", "socket_path", type=click.Path(), default=None,
              help="Socket of the daemon to ask (default as for serve).")
@click.option("--last", type=click.IntRange(1, 10_000), default=10, show_default=True,
              help="How many of the most recent saves to include.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False), required=True,
              help="Where to write the trace (JSON; open it in Perfetto or chrome://tracing).")
@click.option("--timeout", type=float, default=10.0, show_default=True,
              help="Seconds to wait for the daemon's answer.")
def trace(socket_path, last, out_path, timeout) -> None:
    """Write the recent saves' timeline as Chrome trace-event JSON.

    Exit 0 written, 3 no daemon running, 4 the daemon did not answer sensibly.
    """
    from ckptd import status as status_mod

    path = protocol.resolve_socket_path(socket_path)
    code, doc, why = status_mod.query_daemon(path, protocol.MessageType.TRACE, {"last": last},
                                             timeout)
    if doc is None:
        click.echo(why, err=True)
        sys.exit(code)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    saves = sum(1 for e in doc["traceEvents"] if e.get("cat") == "save")
    click.echo(f"{saves} save(s), {len(doc['traceEvents'])} event(s) written to {out_path}")
