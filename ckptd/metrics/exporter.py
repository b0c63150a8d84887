"""Publishing a daemon's metrics: a node-exporter textfile and a loopback HTTP endpoint.

Owns :class:`MetricsExporter`, called from the serve loop's tick: it renders every
:data:`ckptd.knobs.METRICS_INTERVAL` seconds, replaces a node-exporter textfile
atomically, and serves the same families over HTTP on a loopback address
(``prometheus_client``'s WSGI app, restricted to ``/metrics``); and the checks of the
``--metrics-listen`` address.

Pattern: the serve loop is single-threaded and owns the daemon's state, so the HTTP
thread never touches it: it serves the families the last tick built. It must not build
families itself (:mod:`ckptd.metrics.families` does).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Callable, Iterable
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, make_wsgi_app

from ckptd import knobs
from ckptd.metrics.families import LatestFamilies, families_of
from ckptd.metrics.save_stats import SaveStats
from ckptd.storage.durable import write_small_file

__all__ = ["MetricsAddressError", "MetricsExporter", "parse_listen_address", "write_textfile"]

log = logging.getLogger(__name__)


class MetricsAddressError(ValueError):
    """A ``--metrics-listen`` address that is malformed or not allowed."""


def write_textfile(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically, readable by node-exporter's user.

    node-exporter's textfile collector may read at any moment; it must never see a
    half-written file. Not fsynced: a textfile from before a crash is worthless.
    """
    write_small_file(path, text.encode(), mode=0o644, fsync=False, operator_path=True)


def parse_listen_address(text: str, allow_remote: bool = False) -> tuple[str, int]:
    """Parse ``HOST:PORT`` (``[::1]:PORT`` for IPv6) for the metrics endpoint.

    Parameters
    ----------
    text : str
        The ``--metrics-listen`` value.
    allow_remote : bool
        Accept addresses other than loopback (``--metrics-allow-remote``).

    Returns
    -------
    (host, port)

    Raises
    ------
    MetricsAddressError
        If the address is malformed, or not loopback and ``allow_remote`` is false.
    """
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise MetricsAddressError(
            f"metrics address {text!r} is not HOST:PORT; use e.g. 127.0.0.1:9464")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host == "localhost":
        host = "127.0.0.1"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise MetricsAddressError(
            f"metrics host {host!r} is not an IP address; give 127.0.0.1 or ::1") from None
    if not address.is_loopback and not allow_remote:
        raise MetricsAddressError(
            f"refusing to serve metrics on {text}: not a loopback address, and the endpoint "
            "has no authentication; use 127.0.0.1:PORT (scrape through node-exporter's "
            "textfile or a local agent), or pass --metrics-allow-remote to expose it anyway")
    return host, int(port_text)


def _metrics_only(app):
    """Serve ``app`` (prometheus_client's) at ``/metrics`` and ``/``; 404 elsewhere."""
    def restricted(environ, start_response):
        if environ.get("PATH_INFO", "/") not in ("/metrics", "/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        return app(environ, start_response)
    return restricted


class MetricsExporter:
    """Periodic metrics export for a daemon, driven by its serve-loop tick.

    Parameters
    ----------
    textfile : str, optional
        node-exporter textfile to keep up to date (``--metrics-textfile``).
    listen : (host, port), optional
        Address for the HTTP endpoint (``--metrics-listen``), already checked by
        :func:`parse_listen_address`.
    const_labels : dict, optional
        Labels on every sample (``--metrics-label``).
    interval : float, optional
        Seconds between renders (default :data:`ckptd.knobs.METRICS_INTERVAL`).
    """

    def __init__(self, textfile: str | None = None, listen: tuple[str, int] | None = None,
                 const_labels: dict | None = None, interval: float | None = None) -> None:
        self.textfile = textfile
        self.listen = listen
        self.const_labels = dict(const_labels or {})
        self.interval = knobs.METRICS_INTERVAL.get() if interval is None else interval
        self.stats = SaveStats()
        self._latest = LatestFamilies(families_of(None, const_labels=self.const_labels))
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._latest)
        self._next_render = 0.0
        self._server = None
        self._last_failure: str | None = None

    @property
    def text(self) -> str:
        """The exposition text of the last render (what the endpoint serves)."""
        return generate_latest(self._registry).decode()

    @property
    def bound_address(self) -> tuple[str, int] | None:
        """The HTTP endpoint's (host, port), once started."""
        return self._server.server_address[:2] if self._server else None

    def start(self) -> None:
        """Bind the HTTP endpoint (if configured).

        Raises
        ------
        OSError
            If the address cannot be bound (in use, not local).
        """
        if self.listen is None:
            return
        host, port = self.listen
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        try:
            self._server = make_server(host, port, _metrics_only(make_wsgi_app(self._registry)),
                                       server_class, handler_class=_SilentHandler)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: "
                          f"{exc.strerror}; choose another --metrics-listen port") from None
        threading.Thread(target=self._server.serve_forever, name="ckptd-metrics",
                         daemon=True).start()
        bound_host, bound_port = self.bound_address
        log.info("metrics served at http://%s:%d/metrics",
                 bound_host if ":" not in bound_host else f"[{bound_host}]", bound_port)

    def tick(self, requests: Iterable[dict], status: Callable[[], dict]) -> None:
        """Count finished requests; every ``interval`` render and export.

        Never raises: a metrics failure is logged (once per distinct reason) and the
        daemon keeps serving.

        Parameters
        ----------
        requests : iterable of dict
            Every request the daemon still holds, as status entries.
        status : callable
            Builds the current status document.
        """
        try:
            self.stats.observe(requests)
            now = time.monotonic()
            if now < self._next_render:
                return
            self._next_render = now + self.interval
            self.export(status())
        except Exception as exc:  # metrics must never stop the daemon
            self._report_failure(exc)

    def export(self, doc: dict | None) -> None:
        """Build the families of ``doc``; publish them to the endpoint and the textfile.

        Raises
        ------
        OSError
            If the textfile cannot be written.
        """
        self._latest.families = families_of(doc, self.stats, self.const_labels)
        if self.textfile:
            write_textfile(self.textfile, self.text)
        self._last_failure = None

    def close(self) -> None:
        """Publish ``ckptd_up 0`` and stop the HTTP endpoint."""
        try:
            self.export(None)
        except Exception as exc:
            self._report_failure(exc)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _report_failure(self, exc: Exception) -> None:
        reason = f"{type(exc).__name__}: {exc}"
        if reason != self._last_failure:
            log.warning("metrics export failed (%s); the daemon keeps serving. Check that "
                        "the --metrics-textfile directory exists and is writable", reason)
            self._last_failure = reason
