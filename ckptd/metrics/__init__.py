"""Prometheus metrics for one daemon: rendering, textfile export, loopback endpoint.

One concern a module:

- :mod:`~ckptd.metrics.families`   the status document as metric families, rendered by
  ``prometheus_client`` in the text exposition format (:func:`render`);
- :mod:`~ckptd.metrics.save_stats` :class:`SaveStats`, what the status document cannot
  keep: a cumulative histogram of save durations and a count of aborted saves;
- :mod:`~ckptd.metrics.exporter`   :class:`MetricsExporter`, the serve loop's periodic
  export to a node-exporter textfile and a loopback HTTP endpoint.

This face re-exports their names. Nothing here imports torch (``ckptd status`` shares
the import path).
"""

from ckptd.metrics.exporter import (MetricsAddressError, MetricsExporter, parse_listen_address,
                                    write_textfile)
from ckptd.metrics.families import RESERVED_LABELS, families_of, render
from ckptd.metrics.save_stats import DURATION_BUCKETS, SaveStats

__all__ = ["DURATION_BUCKETS", "MetricsAddressError", "MetricsExporter", "RESERVED_LABELS",
           "SaveStats", "families_of", "parse_listen_address", "render", "write_textfile"]
