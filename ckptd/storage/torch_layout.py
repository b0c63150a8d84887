"""torch-format files from a per-layout template: a save whose structure did not change
serializes nothing per tensor.

Owns the writer's fast path for ckptd's own torch files (``TorchAsyncCheckpoint``: 4 KiB
storage alignment, no zip CRCs). Without zip CRCs, every byte of such a file except its
tensors' own is fixed by two things:

- the *head*: the skeleton (its ``data.pkl`` record and the ``.format_version`` record after
  it), a function of the skeleton's msgpack bytes and the tensors' dtypes and shapes;
- the *body*: everything from there on (the other records' headers, padding, data
  descriptors, the central directory and the end records), a function of the position the
  head ends at, the alignment and the storages' dtypes and shapes. A step counter that
  changes in the skeleton changes the head, rarely the position it ends at (the records
  after it start on the next 4 KiB boundary), so the body is reused.

Both are built once (by :mod:`ckptd.storage.torch_format`'s own writer, around tensors
whose pages are never touched) and kept for the next saves; a save with a known layout is
then a few joins of small pieces and one write per large tensor, straight from its buffer
(the staging pool). The result is byte for byte what :func:`write_torch_file` writes (and
so what ``torch.save`` writes with a 4 KiB ``storage_alignment`` and no CRCs); a tensor
whose bytes start with a zip data descriptor's signature (torch counts such a write in the
serialization id) takes :func:`write_torch_file` itself.

Must not import torch.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict
from typing import Any, Callable, NamedTuple, Sequence

from ckptd import knobs
from ckptd.protocol import unpack_value
from ckptd.storage.torch_format import (PAGE_ALIGNMENT, raw_tensor, write_archive,
                                        write_head_records, write_torch_file)
from ckptd.storage.torch_pickle import pickle_skeleton
from ckptd.storage.torch_zip import END_RECORDS_SIZE, GATHER_BELOW, ArchiveWriter

__all__ = ["TorchLayout", "torch_layout_size", "write_torch_layout"]

_DESCRIPTOR_SIGNATURE = b"PK\x07\x08"
# Pieces under this size are joined with their neighbours into one write of up to
# knobs.TORCH_JOIN_BYTES (a copy of a few KiB is cheaper than a write call); larger tensors
# go to the stream from their own buffer (the archive writer's own rule, so the template's
# cuts fall where it wrote them). How many heads and bodies are kept: knobs.TORCH_*_KEPT.
_OWN_WRITE_FROM = GATHER_BELOW


class _Head(NamedTuple):
    """The part of a file the skeleton decides (see the module's docstring)."""

    prefix: bytes                 # data.pkl and .format_version, records and data
    central: bytes                # their central directory entries
    storages: tuple[int, ...]     # the tensor behind each storage key 0, 1, ...
    body_key: tuple               # which body follows it


class _Body(NamedTuple):
    """The rest of the file, as write groups: a group is one write; its items are literal
    bytes or indices into the save's table (the storages' buffers, then the head's
    prefix and central entries); a bare index is a large tensor written from its buffer."""

    groups: tuple
    literal_bytes: int            # of the literal items: the file's size less the table's


_heads: OrderedDict = OrderedDict()
_bodies: OrderedDict = OrderedDict()


def _remember(cache: OrderedDict, key: Any, value: Any, kept: int) -> Any:
    cache[key] = value
    while len(cache) > kept:
        cache.popitem(last=False)
    return value


class _Sink:
    """Keeps what an archive writer writes except the writes straight from
    ``hole_buffer`` (the large tensors' bytes), and where those were."""

    def __init__(self, hole_buffer: Any = None) -> None:
        self.kept, self.holes, self.position = bytearray(), [], 0
        self.hole_buffer = hole_buffer

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if self.hole_buffer is not None and view.obj is self.hole_buffer:
            self.holes.append((self.position, view.nbytes))
        else:
            self.kept += view
        self.position += view.nbytes
        return view.nbytes

    def between(self, start: int, end: int, skipped: int) -> bytes:
        """The archive's bytes ``[start, end)``, ``skipped`` hole bytes lying before them."""
        return bytes(self.kept[start - skipped:end - skipped])


def _head(skeleton: bytes, specs: tuple, buffers: Sequence[Any], alignment: int) -> _Head:
    tensors = [raw_tensor(buffer, dtype, shape)  # checks that every size adds up
               for buffer, (dtype, shape, _) in zip(buffers, specs)]
    data_pkl, storages = pickle_skeleton(unpack_value(skeleton), tensors)
    index_of = {id(tensor): index for index, tensor in enumerate(tensors)}
    order = tuple(index_of[id(storage)] for storage in storages)
    sink = _Sink()
    archive = ArchiveWriter(sink, False, None, alignment)
    write_head_records(archive, data_pkl)
    archive.flush()
    body_key = (alignment, sink.position, len(archive.central),
                tuple(specs[index] for index in order))
    return _Head(bytes(sink.kept), bytes(archive.central), order, body_key)


def _body(skeleton: bytes, specs: tuple, head: _Head) -> _Body:
    """Write the whole archive once around untouched pages and cut it around the
    tensors' bytes."""
    alignment, head_end, central_head, storage_specs = head.body_key
    largest = max((nbytes for _, _, nbytes in specs), default=0)
    pages = mmap.mmap(-1, max(largest, 1))
    try:
        whole = memoryview(pages)
        sink = _Sink(pages)
        fakes = [raw_tensor(whole[:nbytes], dtype, shape) for dtype, shape, nbytes in specs]
        archive = write_archive(sink, unpack_value(skeleton), fakes, False, None, alignment)
        del fakes
        whole.release()
    finally:
        pages.close()
    if sink.between(0, head_end, 0) != head.prefix:
        raise AssertionError("an archive's head differs between two writes of one skeleton")
    directory = archive.position - END_RECORDS_SIZE - len(archive.central)
    table_prefix, table_central = len(storage_specs), len(storage_specs) + 1
    groups: list = []
    group: list = [table_prefix]
    group_bytes = len(head.prefix)
    join_bytes = knobs.TORCH_JOIN_BYTES.get()
    position, skipped, holes = head_end, 0, iter(sink.holes)
    for key, (_, _, nbytes) in enumerate(storage_specs):
        start = archive.data_starts[4 + key]
        gap = sink.between(position, start, skipped)
        if nbytes >= _OWN_WRITE_FROM:
            group.append(gap)
            groups.append(group)
            groups.append(key)
            group, group_bytes = [], 0
            skipped += sum(length for _, length in _holes_within(holes, start, nbytes))
        else:
            group += [gap, key]
            group_bytes += len(gap) + nbytes
            if group_bytes >= join_bytes:
                groups.append(group)
                group, group_bytes = [], 0
        position = start + nbytes
    group += [sink.between(position, directory, skipped), table_central,
              sink.between(directory + central_head, archive.position, skipped)]
    groups.append(group)
    literal = sum(len(item) for g in groups if isinstance(g, list) for item in g
                  if type(item) is not int)
    return _Body(tuple(tuple(g) if isinstance(g, list) else g for g in groups), literal)


def _holes_within(holes, start: int, nbytes: int) -> list:
    """The holes (writes of one tensor's bytes, in slices) covering ``[start, +nbytes)``."""
    taken, covered = [], 0
    while covered < nbytes:
        position, length = next(holes)
        if position != start + covered:
            raise AssertionError("a large tensor's bytes were not written in one run")
        taken.append((position, length))
        covered += length
    return taken


def _head_for(skeleton: bytes, specs: tuple, buffers: Sequence[Any], alignment: int) -> _Head:
    head_key = (skeleton, specs, alignment)
    head = _heads.get(head_key)
    if head is None:
        head = _remember(_heads, head_key, _head(skeleton, specs, buffers, alignment),
                         knobs.TORCH_HEADS_KEPT.get())
    return head


def _body_for(skeleton: bytes, specs: tuple, head: _Head) -> _Body:
    body = _bodies.get(head.body_key)
    if body is None:
        body = _remember(_bodies, head.body_key, _body(skeleton, specs, head),
                         knobs.TORCH_BODIES_KEPT.get())
    return body


class TorchLayout:
    """One file :func:`write_torch_layout` writes, prepared once: its templates are looked
    up (made if new) here, so the writer that allocates the file first (:attr:`size`) and
    then writes it (:meth:`write`) normalizes the specs and looks the templates up once."""

    def __init__(self, skeleton: bytes, specs: Sequence[Sequence], buffers: Sequence[Any],
                 alignment: int = PAGE_ALIGNMENT) -> None:
        self.skeleton, self.buffers, self.alignment = skeleton, buffers, alignment
        self.specs = tuple((dtype, tuple(shape), nbytes) for dtype, shape, nbytes in specs)
        self.head = _head_for(skeleton, self.specs, buffers, alignment)
        self._body: _Body | None = None

    @property
    def body(self) -> _Body:
        if self._body is None:
            self._body = _body_for(self.skeleton, self.specs, self.head)
        return self._body

    @property
    def size(self) -> int:
        """The file's size, before it is written.

        A direct writer allocates the whole file before its first write: space allocated as
        the writes go waits for every write in flight (the file's end records, a few KiB
        after its last tensor, waited for that tensor's write to finish when only the
        tensors' bytes were allocated up front).
        """
        head = self.head
        # every storage, the head's prefix and its central entries appear once in the groups
        return (self.body.literal_bytes + len(head.prefix) + len(head.central)
                + sum(self.specs[index][2] for index in head.storages))

    def write(self, stream: Any, max_write: int | None = None,
              staged: Callable[[int], None] | None = None) -> int:
        """Write the file to ``stream`` (see :func:`write_torch_layout`); returns its size.

        ``staged(i)``: returns once ``buffers[i]`` holds its final bytes (the file is
        written while the trainer still copies): every buffer is waited for before a byte
        of it is read, so the check for a descriptor's signature is made buffer by buffer
        too, and a tensor that has one turns the rest of the file, once every buffer is
        staged, into :func:`write_torch_file`'s (the same bytes up to there).
        """
        head, buffers = self.head, self.buffers
        views = [memoryview(buffers[index]).cast("B") for index in head.storages]
        if staged is None and any(_signed(view) for view in views):
            return self._as_torch_file(stream, max_write)
        table = views + [head.prefix, head.central]
        written = 0
        for group in self.body.groups:
            if staged is not None and self._signed_when_staged(group, views, staged):
                for index in range(len(buffers)):
                    staged(index)
                return self._as_torch_file(_From(stream, written), max_write)
            if type(group) is int:
                view = views[group]
                step = max_write or view.nbytes
                for start in range(0, view.nbytes, step):
                    stream.write(view[start:start + step])
                written += view.nbytes
            else:
                piece = b"".join([table[item] if type(item) is int else item for item in group])
                stream.write(piece)
                written += len(piece)
        return written

    def _signed_when_staged(self, group, views: list, staged: Callable[[int], None]) -> bool:
        """Wait for the buffers ``group`` reads; whether one starts with the signature."""
        signed = False
        for item in (group,) if type(group) is int else group:
            if type(item) is int and item < len(views):
                staged(self.head.storages[item])
                signed = signed or _signed(views[item])
        return signed

    def _as_torch_file(self, stream: Any, max_write: int | None) -> int:
        tensors = [raw_tensor(buffer, dtype, shape)
                   for buffer, (dtype, shape, _) in zip(self.buffers, self.specs)]
        return write_torch_file(stream, unpack_value(self.skeleton), tensors,
                                max_write=max_write, alignment=self.alignment)


def _signed(view: memoryview) -> bool:
    """Whether a tensor's bytes start like a zip data descriptor (torch counts such a
    write in the serialization id, which the templates do not)."""
    return view.nbytes >= 8 and view[:4] == _DESCRIPTOR_SIGNATURE


class _From:
    """A stream that drops the first ``skip`` bytes written to it: those are in the file
    already (the same bytes, written from the templates)."""

    def __init__(self, stream: Any, skip: int) -> None:
        self.stream, self.skip, self.position = stream, skip, 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.position += view.nbytes
        if self.skip >= view.nbytes:
            self.skip -= view.nbytes
            return view.nbytes
        self.stream.write(view[self.skip:])
        self.skip = 0
        return view.nbytes

    def tell(self) -> int:
        return self.position


def torch_layout_size(skeleton: bytes, specs: Sequence[Sequence], buffers: Sequence[Any],
                      alignment: int = PAGE_ALIGNMENT) -> int:
    """The size of the file :func:`write_torch_layout` writes for these arguments, before
    it is written (:attr:`TorchLayout.size`; a writer doing both uses one
    :class:`TorchLayout`)."""
    return TorchLayout(skeleton, specs, buffers, alignment).size


def write_torch_layout(stream: Any, skeleton: bytes, specs: Sequence[Sequence],
                       buffers: Sequence[Any], *, max_write: int | None = None,
                       alignment: int = PAGE_ALIGNMENT) -> int:
    """Write the file :func:`write_torch_file` writes for ``skeleton`` (no zip CRCs),
    from templates kept across calls (see the module's docstring).

    Parameters
    ----------
    stream
        Has ``write(buffer)``; written strictly in order.
    skeleton : bytes
        The structure, as :func:`ckptd.protocol.pack_value` made it.
    specs : sequence of (dtype, shape, nbytes)
        Of each tensor the skeleton refers to by index.
    buffers : sequence of buffers
        Each tensor's bytes (views of the staging pool), never copied when large.
    max_write, alignment
        As for :func:`write_torch_file` (which also says what is raised, and when).

    Returns
    -------
    int
        The file's size.
    """
    return TorchLayout(skeleton, specs, buffers, alignment).write(stream, max_write)
