"""The save service's hand-over to the CUDA stager: device copies of save requests.

Owns no state of a request: it starts a request's device-to-host copy once the lifecycle
leased its extent, cancels it (or releases never-opened handles) when the save ends early,
and reports the stager's results to :class:`ckptd.server.lifecycle.SaveLifecycle`, which
alone decides the phase. It must not touch extents, files or replies.
"""

from __future__ import annotations

from ckptd.protocol import ErrorCode
from ckptd.server.endpoint import RequestError
from ckptd.server.lifecycle import DEVICE_COPY, SaveLifecycle
from ckptd.server.ranks import RankRegistry
from ckptd.server.requests import RequestTable, SaveRequest


class DeviceCopies:
    """The save service's hand-over to the CUDA stager (``None`` on a node without CUDA).

    Owns nothing of a request: it starts a request's device copy once the lifecycle
    leased its extent, cancels it (or releases never-opened handles) when the save ends
    early, and reports results to the lifecycle, which alone decides the phase.
    """

    def __init__(self, cuda, ranks: RankRegistry, table: RequestTable,
                 lifecycle: SaveLifecycle) -> None:
        self.cuda, self.ranks, self.table, self.lifecycle = cuda, ranks, table, lifecycle

    def check(self, rank: int) -> None:
        """Refuse CUDA handles on a daemon without a device."""
        if self.cuda is None:
            raise RequestError(ErrorCode.BAD_REQUEST,
                               f"rank {rank}: this daemon has no CUDA device",
                               "send CPU copies through the staging pool instead")

    def release_unopened(self, specs: list | None, routing_id: bytes) -> None:
        """Handles of a refused request: handed over, never to be opened."""
        if specs and self.cuda is not None:
            self.cuda.release(specs, self._pid(routing_id))

    def _pid(self, routing_id: bytes) -> int | None:
        try:
            return self.ranks.of(routing_id).pid
        except RequestError:  # never registered: nothing of it can be held open
            return None

    def start(self, request: SaveRequest) -> None:
        """Queue the request's device-to-host copy into its leased extent."""
        if DEVICE_COPY not in request.copiers:
            return
        from ckptd.staging.cuda import CudaJob

        rank = self.ranks.of(request.routing_id)
        self.cuda.submit(CudaJob(request.id, request.extent.offset, request.offsets,
                                 request.buffers, request.cuda_specs, rank.pid))

    def cancel(self, request: SaveRequest) -> None:
        """Stop the copy of a save that ended early, or release its handles if queued."""
        if self.cuda is None:
            return
        if request.lease is None:  # still queued for space: its copy never started
            self.cuda.release(request.cuda_specs, self._pid(request.routing_id))
        else:
            self.cuda.cancel(request.id)

    def on_copied(self, result) -> None:
        """A :class:`ckptd.staging.cuda.CudaStaged` arrived from the stager."""
        request = self.table.find(result.request_id)
        if request is not None:
            request.ipc_kept = list(result.kept)
            self.lifecycle.copied(request, DEVICE_COPY, result.error, result.code)
