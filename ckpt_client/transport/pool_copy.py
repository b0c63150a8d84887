"""Copying a save's buffers into the daemon's staging pool, mapped in this process.

Owns the trainer's share of the copy: CPU tensors, byte items, and the CUDA tensors the
daemon cannot open itself. Destination views are cached per (extent offset, layout): a
training job saves the same structure into the same place again and again, and building
thousands of views per save would cost more than copying small tensors. The CPU tensors
and byte items of a save are copied by one ``torch._foreach_copy_`` call (it releases the
GIL), so many small buffers cost little more than one; a large save is copied in a few
such calls in extent order, each end reported to the daemon
(:mod:`ckpt_client.transport.copy_reports`) so its writers start while the rest is
copied. The copy runs without autograd:
sources are the caller's own tensors (parameters included, never detached one by one),
and a copy that autograd recorded would tie the pool to their graph.
"""

from __future__ import annotations

import io
import warnings
from collections import OrderedDict
from typing import Callable

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
        self._cuts: tuple | None = None  # (views, step, [(end index, end offset)]) of the last

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
             on_cpu: bool = False, reports: Callable[[int], None] | None = None) -> None:
        """Copy ``sources[i]`` for ``i`` in ``chosen`` to ``base + offsets[i]``.

        ``on_cpu``: the caller knows every source is a CPU tensor (no check of each).
        ``reports``: a :class:`~ckpt_client.transport.copy_reports.CopyReports`; a copy of
        host buffers only is then made in steps of ``reports.step`` bytes, in extent order,
        and ``reports(end)`` told after each but the last.
        """
        with torch.no_grad():
            self._copy(base, offsets, buffers, sources, chosen, on_cpu, reports)

    def _copy(self, base: int, offsets: list, buffers: list, sources: list, chosen: list,
              on_cpu: bool, reports) -> None:
        chosen, destinations = self._destinations(base, offsets, buffers, chosen)
        picked = [sources[i] for i in chosen]
        if on_cpu or all(type(s) in _PLAIN_TENSORS and not s.is_cuda for s in picked):
            if picked and reports is None:  # the usual save: CPU tensors only, one call
                torch._foreach_copy_(destinations, picked)
            elif picked:
                self._copy_in_steps(destinations, picked, self._steps(
                    destinations, reports.step, (offsets[i] + buffers[i][2] for i in chosen)),
                    reports)
            return
        host_dst, host_src, host_ends, device = [], [], [], False
        with warnings.catch_warnings():
            # torch warns that read-only buffers (bytes) could be written through the
            # tensor; these are only read, as sources of the copy.
            warnings.simplefilter("ignore", UserWarning)
            for index, destination, source in zip(chosen, destinations, picked):
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
                host_ends.append(offsets[index] + buffers[index][2])
        if host_dst and (reports is None or device):
            torch._foreach_copy_(host_dst, host_src)  # one call for every host buffer
        elif host_dst:
            self._copy_in_steps(host_dst, host_src,
                                _cut(host_ends, reports.step), reports)
        if device:
            torch.cuda.synchronize()

    def _steps(self, views: list, step: int, ends) -> list:
        """Where a copy into ``views`` (cached: the same list save after save) is cut."""
        if self._cuts is None or self._cuts[0] is not views or self._cuts[1] != step:
            self._cuts = (views, step, _cut(list(ends), step))
        return self._cuts[2]

    @staticmethod
    def _copy_in_steps(destinations: list, sources: list, cuts: list, reports) -> None:
        start = 0
        for stop, end in cuts:
            torch._foreach_copy_(destinations[start:stop], sources[start:stop])
            if stop < len(destinations):  # the last step is STAGED's to report
                reports(end)
            start = stop


def _cut(ends: list, step: int) -> list:
    """``[(stop index, end offset)]``: consecutive buffers (``ends``: where each ends in the
    extent, ascending) grouped into steps of at least ``step`` bytes, the last step
    ending with the last buffer."""
    cuts, target = [], step
    for index, end in enumerate(ends):
        if end >= target:
            cuts.append((index + 1, end))
            target = end + step
    if not cuts or cuts[-1][0] != len(ends):
        cuts.append((len(ends), ends[-1]))
    return cuts
