"""Copying a save's buffers into the daemon's staging pool, mapped in this process.

Owns the trainer's share of the copy: CPU tensors, byte items, and the CUDA tensors the
daemon cannot open itself. Destination views are cached per (extent offset, layout): a
training job saves the same structure into the same place again and again, and building
thousands of views per save would cost more than copying small tensors. The CPU tensors
and byte items of a save are copied by one ``torch._foreach_copy_`` call (it releases the
GIL), so many small buffers cost little more than one. The copy runs without autograd:
sources are the caller's own tensors (parameters included, never detached one by one),
and a copy that autograd recorded would tie the pool to their graph.
"""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict

import torch

_PLAIN_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})


class PoolCopier:
    """Copies a save's buffers into the connection's mapped pool.

    Destination views are cached per (extent offset, layout): a training job saves the
    same structure into the same place again and again, and building thousands of views
    per save would cost more than copying small tensors.
    """

    _CACHED_LAYOUTS = 4

    def __init__(self, pool: torch.Tensor) -> None:
        self.pool = pool
        self._views: OrderedDict = OrderedDict()
        self._last: tuple | None = None  # (base, buffers, chosen, non-empty chosen, views)

    def _destinations(self, base: int, offsets: list, buffers: list,
                      chosen: list) -> tuple[list, list]:
        """The non-empty buffers of ``chosen`` and a view of the pool for each."""
        last = self._last
        if last is not None and last[0] == base and last[1] is buffers and last[2] == chosen:
            # The layout a save sent ahead is the very list of the save before (the
            # entry holds it, so its id cannot be reused): no key over every buffer.
            return last[3], last[4]
        chosen_nonempty = [i for i in chosen if buffers[i][2]]
        key = (base, tuple(chosen_nonempty), tuple((b[0], tuple(b[1])) for b in buffers))
        views = self._views.get(key)
        if views is None:
            views = []
            for index in chosen_nonempty:
                dtype, shape, nbytes = buffers[index]
                start = base + offsets[index]
                raw = self.pool[start:start + nbytes]
                views.append(raw if dtype == "bytes" else raw.view(getattr(torch, dtype)).view(shape))
            self._views[key] = views
            while len(self._views) > self._CACHED_LAYOUTS:
                self._views.popitem(last=False)
        self._views.move_to_end(key)
        self._last = (base, buffers, list(chosen), chosen_nonempty, views)
        return chosen_nonempty, views

    def copy(self, base: int, offsets: list, buffers: list, sources: list, chosen: list, *,
             on_cpu: bool = False) -> None:
        """Copy ``sources[i]`` for ``i`` in ``chosen`` to ``base + offsets[i]``.

        ``on_cpu``: the caller knows every source is a CPU tensor (no check of each).
        """
        with torch.no_grad():
            self._copy(base, offsets, buffers, sources, chosen, on_cpu)

    def _copy(self, base: int, offsets: list, buffers: list, sources: list, chosen: list,
              on_cpu: bool) -> None:
        chosen, destinations = self._destinations(base, offsets, buffers, chosen)
        picked = [sources[i] for i in chosen]
        if on_cpu or all(type(s) in _PLAIN_TENSORS and not s.is_cuda for s in picked):
            if picked:  # the usual save: CPU tensors only, one call for all of them
                torch._foreach_copy_(destinations, picked)
            return
        host_dst, host_src, device = [], [], False
        with warnings.catch_warnings():
            # torch warns that read-only buffers (bytes) could be written through the
            # tensor; these are only read, as sources of the copy.
            warnings.simplefilter("ignore", UserWarning)
            for destination, source in zip(destinations, picked):
                if type(source) in _PLAIN_TENSORS or isinstance(source, torch.Tensor):
                    if source.is_cuda:
                        destination.copy_(source, non_blocking=True)
                        device = True
                        continue
                else:  # a byte item joins the one batched copy as a uint8 view
                    source = torch.frombuffer(source.getbuffer() if isinstance(source, io.BytesIO)
                                              else memoryview(source), dtype=torch.uint8)
                host_dst.append(destination)
                host_src.append(source)
        if host_dst:
            torch._foreach_copy_(host_dst, host_src)  # one call for every host buffer
        if device:
            torch.cuda.synchronize()
