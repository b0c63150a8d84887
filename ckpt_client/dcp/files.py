"""DCP's file layout as ckptd writes it: names, and which items go into which file.

Owns the names (``.metadata``, ``<prefix>…<n>.distcp``), the balanced grouping of a
rank's items into files (:func:`split_into_files`), the packing of those files into
requests that fit the daemon's staging pool (:func:`chunk_files`, :func:`grouping`), and
resolving a plan's items into the data to stage (:func:`resolve_items`). No connection,
no collective; the groupings last worked out are kept (a training loop repeats them).
"""

from __future__ import annotations

import functools
import io

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from ckptd import knobs, protocol
import ckpt_client.dcp.fast_plan as fast_plan

#: The file DCP reads first; written last, by the coordinator, so a checkpoint is
#: either complete or invisible.
METADATA_NAME = ".metadata"
DCP_SUFFIX = ".distcp"


def item_nbytes(source) -> int:
    """Bytes of one resolved DCP item (a tensor or an ``io.BytesIO``)."""
    if isinstance(source, torch.Tensor):
        return source.numel() * source.element_size()
    return source.getbuffer().nbytes


def split_into_files(sizes: list[int], count: int) -> list[list[int]]:
    """Indices of items of ``sizes`` bytes grouped into ``count`` files of balanced size."""
    count = max(1, min(count, len(sizes)))
    groups: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for index in sorted(range(len(sizes)), key=sizes.__getitem__, reverse=True):
        target = totals.index(min(totals))
        groups[target].append(index)
        totals[target] += sizes[index]
    return [sorted(g) for g in groups if g]


def chunk_files(sources: list, count: int, pool_size: int) -> list[list[list[int]]]:
    """Group ``sources`` into files, and the files into requests that fit the pool.

    Returns
    -------
    list of chunks
        Each chunk is a list of files (lists of source indices) whose staged layout is at
        most ``pool_size`` bytes; one chunk when everything fits at once.
    """
    return chunk_sizes(tuple(item_nbytes(s) for s in sources), count, pool_size)


@functools.lru_cache(maxsize=8)
def chunk_sizes(sizes: tuple, count: int, pool_size: int) -> list[list[list[int]]]:
    """:func:`chunk_files` by item sizes: a training loop saves the same sizes again and
    again, so the grouping (a sort and a layout per file) is worked out once. Callers
    only read the result."""
    total = protocol.layout_extent(sizes)[1]
    if total > pool_size:  # more, smaller files, so that chunks can be packed
        count = max(count, -(-total // max(pool_size // 2, 1)))
    chunks: list[list[list[int]]] = []
    used = 0
    for group in split_into_files(sizes, count):
        need = protocol.layout_extent([sizes[i] for i in group])[1]
        if chunks and used + need <= pool_size:
            chunks[-1].append(group)
            used += need
        else:
            chunks.append([group])
            used = need
    return chunks or [[]]


#: (buffers, (file count, pool size), what :func:`grouping` made of them) of the last call.
_last_grouping: tuple | None = None


def grouping(buffers: list, count: int, pool_size: int) -> list[tuple[list, list]]:
    """The requests a rank's save of ``buffers`` (``[dtype, shape, nbytes]`` each) is
    staged in: per request, the sorted indices of the buffers it stages and, per file
    of it, those buffers' positions within the request (:func:`chunk_sizes`' grouping).

    Handed out again for the very ``buffers`` list of the call before (a save of an
    unchanged plan stages with its predecessor's descriptions): a pass over a thousand
    items (a tuple of sizes to hash, sorts, a position table) is then skipped. Callers
    only read the result.
    """
    global _last_grouping
    last, setting = _last_grouping, (count, pool_size)
    if last is not None and last[0] is buffers and last[1] == setting \
            and knobs.DCP_KEEP_DESCRIPTIONS.get():
        return last[2]
    made = []
    for chunk in chunk_sizes(tuple(b[2] for b in buffers), count, pool_size):
        members = sorted(i for group in chunk for i in group)
        position = {index: at for at, index in enumerate(members)}
        made.append((members, [[position[i] for i in group] for group in chunk]))
    _last_grouping = (buffers, setting, made)
    return made


def resolve_items(plan: SavePlan, planner: SavePlanner) -> list:
    """The data of each of ``plan``'s items: tensors (not detached: the copy into the
    pool runs without autograd) and ``io.BytesIO``."""
    if fast_plan.resolves(planner):
        return fast_plan.sources(plan, planner)
    sources = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if not isinstance(data, (torch.Tensor, io.BytesIO)):
            raise TypeError(f"planner resolved {item.index.fqn} to {type(data).__name__}")
        sources.append(data)
    return sources
