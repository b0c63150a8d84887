"""Telling the daemon how far a save's copy into its extent got, while it still copies.

Owns the COPIED messages of one save: the copier (:mod:`ckpt_client.transport.pool_copy`)
copies a large save in steps of ``CKPTD_COPY_REPORT_BYTES`` in extent order and reports
the end of each step but the last (STAGED says that one), so the daemon's writers, whose
files were made ready when the save's space was leased, write what is copied while the
rest is copied: the disk starts with the copy, not after it. By default only a copy made
in the background reports (a zero-stall save's), and only on a node with CPUs to spare:
the writes take memory bandwidth and CPU from the copy beside them, which a blocking call
would wait for, and from the training step a background copy overlaps. A report is sent without
waiting for its reply (the daemon answers and the answer is dropped on arrival): a
daemon that cannot use it ignores it, and the save is staged by STAGED as before.
"""

from __future__ import annotations

import os

from ckptd import knobs
from ckptd.protocol import Copied, MessageType
from ckpt_client.transport.connection import DaemonConnection


class CopyReports:
    """The COPIED reports of one save: ``reports(through)`` says bytes ``[0, through)`` of
    its extent are copied; :attr:`step` is how many bytes the copier copies between two.

    Parameters
    ----------
    connection : DaemonConnection
        The save's connection.
    request_id : int
        The save's request.
    skeleton : bytes or None
        A torch save's skeleton when its STAGE went ahead without one: the first report
        carries it, so its file can be laid out before the copy ends.
    step : int
        Bytes between two reports.
    """

    def __init__(self, connection: DaemonConnection, request_id: int,
                 skeleton: bytes | None, step: int) -> None:
        self.connection, self.request_id = connection, request_id
        self.skeleton, self.step = skeleton, step

    def __call__(self, through: int) -> None:
        self.connection.tell(MessageType.COPIED, Copied(
            request_id=self.request_id, through=through, skeleton=self.skeleton))
        self.skeleton = None  # once is enough: the daemon keeps it


def copy_reports(connection: DaemonConnection, request_id: int, skeleton: bytes | None,
                 total: int, background: bool) -> CopyReports | None:
    """The reports of a save of ``total`` bytes, or None where it is too small for two
    steps or reports are off for it (``CKPTD_COPY_REPORTS``: by default only a copy made
    in the ``background``, one no call waits for; ``CKPTD_COPY_REPORT_BYTES=0``)."""
    step, which = knobs.COPY_REPORT_BYTES.get(), knobs.COPY_REPORTS.get()
    if which == "auto":
        spare = len(os.sched_getaffinity(0)) >= knobs.COPY_REPORTS_MIN_CPUS.get()
        which = "background" if spare else "off"
    if which == "off" or (which == "background" and not background) or step <= 0 \
            or total < 2 * step:
        return None
    return CopyReports(connection, request_id, skeleton, step)
