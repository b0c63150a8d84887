"""What a background write of the reference flow hands back: write results or a failure.

The reference passes each rank's outcome from its save function to
``retrieve_write_results`` through a queue and reports a failed write as DCP's wrapped
exception (``(exception, StackSummary)``) whose text starts with ``Worker failure:``.
This module owns those shapes: :class:`WorkerFailure`, :func:`wrap_failure`,
:class:`WriteResultList` (write results plus the checksums ckptd computed per file) and
:class:`WriteResultsSlot` (where the outcome waits).
"""

from __future__ import annotations

import traceback
from typing import Any


class WorkerFailure(RuntimeError):
    """Why the background write of one rank failed (what ``retrieve_write_results`` wraps).

    Parameters
    ----------
    reason : str
        What failed, with the rank and file where known.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return f"Worker failure: {self.reason}"


def wrap_failure(reason: str) -> tuple:
    """``reason`` as DCP's wrapped exception: ``(WorkerFailure, StackSummary)``, picklable."""
    return WorkerFailure(reason), traceback.StackSummary()


def is_wrapped_failure(value: Any) -> bool:
    """Whether ``value`` is a wrapped exception (DCP's ``(exception, StackSummary)``)."""
    return (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], BaseException)
            and isinstance(value[1], traceback.StackSummary))


class WriteResultList(list):
    """One rank's DCP write results, plus the checksums ckptd computed per file.

    Attributes
    ----------
    file_checksums : dict of str to [int, int]
        File name -> ``[crc32, size]`` (empty when the trainer wrote the files itself).
    """

    def __init__(self, results=(), file_checksums: dict | None = None) -> None:
        super().__init__(results)
        self.file_checksums = dict(file_checksums or {})


class WriteResultsSlot:
    """Where a save function leaves its outcome for ``retrieve_write_results``.

    The reference passes a multiprocessing queue in the same place; here the outcome is
    always delivered in the trainer process, so a plain slot is enough.
    """

    def __init__(self) -> None:
        self._outcome: WriteResultList | str | None = None

    def put(self, outcome: WriteResultList | str) -> None:
        """Record the write results, or why the write failed (a string)."""
        self._outcome = outcome

    def take(self) -> WriteResultList | str | None:
        """The outcome (``None`` if none was recorded), once."""
        outcome, self._outcome = self._outcome, None
        return outcome
