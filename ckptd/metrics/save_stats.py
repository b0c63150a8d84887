"""Save statistics the status document cannot hold: every save the daemon saw finish.

Owns :class:`SaveStats`, a cumulative histogram of save durations, the count of aborted
saves and the time of the last success, fed from the requests the daemon offers on each
tick (each finished one counted exactly once). It must not render or export anything.
"""

from __future__ import annotations

from typing import Iterable

from ckptd.protocol.names import Phase

__all__ = ["DURATION_BUCKETS", "SaveStats"]

#: Upper bounds of the save-duration histogram buckets, in seconds.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SaveStats:
    """Cumulative save durations and aborted count, from requests seen finishing.

    The status document keeps only recent requests, so the daemon offers every request
    it still holds on each tick; each finished one is counted exactly once.

    Parameters
    ----------
    buckets : tuple of float
        Histogram upper bounds in seconds (``+Inf`` is added).
    """

    def __init__(self, buckets: tuple = DURATION_BUCKETS) -> None:
        self.buckets = tuple(sorted(buckets))
        self.bucket_counts = [0] * len(self.buckets)
        self.count = 0
        self.sum = 0.0
        self.aborted = 0
        self.last_success: float | None = None
        self._seen: set[int] = set()

    def observe(self, requests: Iterable[dict]) -> None:
        """Count the finished requests among ``requests`` not counted before.

        Parameters
        ----------
        requests : iterable of dict
            Request entries as in the status document (``id``, ``phase``,
            ``created_at``, ``finished_at``).
        """
        present = set()
        for request in requests:
            present.add(request["id"])
            if request["phase"] not in Phase.FINISHED or request["id"] in self._seen:
                continue
            self._seen.add(request["id"])
            if request["phase"] == "aborted":
                self.aborted += 1
            elif request["phase"] == "done" and request.get("finished_at"):
                self._add_duration(request["finished_at"] - request["created_at"])
                self.last_success = max(self.last_success or 0.0, request["finished_at"])
        self._seen &= present  # a request the daemon dropped will not come back

    def _add_duration(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.count += 1
        self.sum += seconds
        for index, bound in enumerate(self.buckets):
            if seconds <= bound:
                self.bucket_counts[index] += 1
