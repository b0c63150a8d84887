"""Building save requests: from a trainer's STAGE, or from a tiered save's journal entry.

Owns no state: it turns a message (or what a previous daemon journaled) into a
:class:`ckptd.server.requests.SaveRequest`, says who fills its extent, and which requests
a trainer's ABORT names (by id, or by the STAGE message that asked for one). Admitting it to
the pool is the lifecycle's; answering the trainer is the save service's.
"""

from __future__ import annotations

import os

import dataclasses

from ckptd import knobs, protocol
from ckptd.protocol import Abort, ErrorCode, Phase, ProtocolError, SaveFormat, Stage
from ckptd.server.endpoint import RequestError
from ckptd.server.lifecycle import CLIENT_COPY, DEVICE_COPY
from ckptd.server.ranks import RankInfo
from ckptd.server.requests import RequestTable, SaveRequest
from ckptd.storage.layout import predict_placements
from ckptd.storage.roots import PathRefusedError


def copiers_of(request: SaveRequest) -> tuple[str, ...]:
    """Who fills the extent: the trainer (buffers without a spec; also an empty
    save, which the trainer confirms), the CUDA stager (buffers with one), or both."""
    specs = request.cuda_specs or [None] * len(request.buffers)
    device = any(spec is not None for spec in specs)
    client = any(spec is None for spec in specs) or not specs
    return ((CLIENT_COPY,) if client else ()) + ((DEVICE_COPY,) if device else ())


def _with_kept_layout(rank: RankInfo, body: Stage) -> Stage:
    """``body`` with the buffers of the earlier request of ``rank``'s connection that its
    ``layout_of`` names (``body`` itself when it names none).

    A training loop saves one structure again and again; the trainer then names the last
    save's request instead of sending (and having this loop decode and check) a thousand
    buffer descriptions while it waits for the reply.

    Raises
    ------
    RequestError
        ``layout_unknown`` if that request's layout is not kept (the trainer sends the
        buffers then).
    """
    if body.layout_of is None:
        return body
    kept = _kept_layout(rank, body)
    if kept is None:
        raise RequestError(ErrorCode.LAYOUT_UNKNOWN,
                           f"rank {rank.rank}: the layout of request {body.layout_of} is not "
                           "kept any more", "send the STAGE with its buffers")
    body = dataclasses.replace(body, buffers=kept[0])
    try:
        body.check_files()  # a DCP save's files came with the name, unchecked
    except ProtocolError as exc:
        raise RequestError(exc.code, f"rank {rank.rank}: {exc.message} by the layout of "
                                     f"request {body.layout_of}",
                           "send the STAGE with its buffers") from None
    return body


def _kept_layout(rank: RankInfo, body: Stage) -> tuple | None:
    """What ``rank``'s connection keeps of the layout ``body`` names (of its format)."""
    return rank.layouts.get(body.format, {}).get(body.layout_of)


def _layout_of(rank: RankInfo, body: Stage) -> tuple[list, int]:
    """Offsets and extent length of ``body``'s buffers (a kept layout's, if it names one)."""
    kept = _kept_layout(rank, body)  # None for a STAGE that names none
    if kept is not None and kept[0] is body.buffers:
        return kept[1], kept[2]
    return protocol.layout_extent([b[2] for b in body.buffers])


def _keep_layout(rank: RankInfo, request: SaveRequest) -> None:
    """Keep a torch or DCP save's layout for the next save of the same structure to name.

    Up to ``SENT_AHEAD_KINDS`` of each format: a trainer saves a handful of kinds of state
    dict in turn, and a guess names the layout of the last save of its own kind (the DCP
    guess keeps up to ``DCP_GUESS_KINDS`` kinds), so keeping fewer refuses each name."""
    kept = rank.layouts[request.format]
    kept[request.id] = (request.buffers, request.offsets, request.extent_length)
    while len(kept) > max(knobs.SENT_AHEAD_KINDS.get(), 0):
        kept.popitem(last=False)


def request_from_stage(daemon, rank: RankInfo, body: Stage) -> SaveRequest:
    """The request a trainer's STAGE asks for (its path checked, its extent laid out).

    A tiered save never names a kept layout (the stage budget is sized from the buffers
    before this runs): its layouts are not kept, so such a STAGE is refused here.
    """
    body = _with_kept_layout(rank, body)
    try:
        if body.format == SaveFormat.LOCAL:  # the store names the part: session, iteration, rank
            path = daemon.local.part_path_for(rank.rank, body.session, body.iteration)
        else:
            path = daemon.roots.check(body.path)
    except PathRefusedError as exc:
        raise RequestError(ErrorCode.PATH_REFUSED, f"rank {rank.rank}: {exc}") from None
    offsets, length = _layout_of(rank, body)
    request_id = daemon.table.new_id()
    tier = daemon.tier
    tiered = tier is not None and tier.wants(body.format)
    request = SaveRequest(
        id=request_id, stage_key=tier.key_for(request_id) if tiered else None,
        rank=rank.rank, routing_id=rank.routing_id, format=body.format,
        path=path, buffers=body.buffers, offsets=offsets, extent_length=length,
        skeleton=body.skeleton, files=body.files if body.format == SaveFormat.DCP else [],
        cuda_specs=body.cuda, session=body.session, iteration=body.iteration,
        stock_files=body.format == SaveFormat.DCP and body.stock_files,
        trainer_pid=rank.pid,
        near=daemon.placement.near(body.cuda, rank.pid))
    if tiered and body.format == SaveFormat.DCP:
        # Known now, so the coordinator can hand its commit over at staging time.
        request.placements = predict_placements(body.buffers, body.files,
                                                request.stock_files)
    if body.format in (SaveFormat.TORCH, SaveFormat.DCP) and not tiered:
        _keep_layout(rank, request)
    return request


def named_by(abort: Abort, request: SaveRequest) -> bool:
    """Whether ``abort`` (from ``request``'s connection) drops ``request``: it names all
    requests, or this one's id, or the STAGE message that asked for it (the trainer gave
    up waiting for that reply, so the request would otherwise hold its staging space,
    unused, until the staging deadline)."""
    return (abort.request_ids is None or request.id in abort.request_ids
            or (request.stage_message is not None and request.stage_message in abort.stages))


def request_from_journal(table: RequestTable, key: str, entry: dict, files: list) -> SaveRequest:
    """A tiered save a previous daemon left in the journal, flushing again."""
    total = sum(f.size for f in files)
    request = SaveRequest(
        id=table.new_id(), rank=int(entry["rank"]), routing_id=b"",
        format=str(entry["format"]), path=str(entry["target"]),
        buffers=[["bytes", [total], total]], offsets=[0], extent_length=0,
        phase=Phase.FLUSHING, stage_key=key)
    request.written = [{"name": os.path.basename(f.target), "path": f.local,
                        "size": f.size, "crc32": f.crc32} for f in files]
    request.staged_at = request.created_at
    table.add(request)
    return request
