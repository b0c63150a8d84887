"""Reading a local-checkpoint part into tensors: from its file, or from the daemon's memory.

A part is a msgpack header (:func:`ckptd.protocol.decode_part_header`) and the raw bytes
of its tensors where :func:`ckptd.protocol.part_layout` puts them; nothing is unpickled.
Either way the bytes land once, in one fresh buffer, and every tensor is a view of it
(a tensor whose offset does not suit its dtype, possible only in a version 1 part, is
copied out alone). Every byte is checked against the part's checksum, in the algorithm
its record names, in the same pass that moves it (:mod:`ckpt_client.local.part_io`):

- :func:`read_part` reads the file: a version 2 part (every tensor aligned in the file)
  with O_DIRECT straight into page-aligned memory where the filesystem allows, else (and
  a version 1 part always) through the page cache. Its checksum record beside it is
  compared at the end: a flipped byte on disk is never loaded, even in a file the daemon
  verified earlier (its record of that says nothing about the disk since);
- :func:`read_resident` copies a part the daemon keeps in its staging pool (the memory
  tier) and checks the copy against the checksum the daemon's writer recorded: shared
  memory that changed (reused for another save, or scribbled on) is never loaded.
"""

from __future__ import annotations

import os

import torch

from ckptd import protocol
from ckptd.checksum import (Checksum, ChecksumMismatchError, algorithm_named, check_matches,
                            read_sidecar, verify_file)
from ckpt_client.local.part_io import (PAGE, aligned_start, copy_into, direct_reads_for,
                                       read_file_into)

_ELEMENT_SIZE = {name: (torch.empty(0, dtype=getattr(torch, name)).element_size()
                        if hasattr(torch, name) else 1) for name in protocol.BUFFER_DTYPES}


def _tensor_specs(path: str, header: dict) -> list:
    specs = []
    for dtype, shape, nbytes in header["buffers"]:
        if dtype not in protocol.BUFFER_DTYPES or dtype == "bytes":
            raise ValueError(f"{path}: buffer dtype {dtype!r} is not a tensor dtype")
        specs.append((dtype, list(shape), int(nbytes)))
    return specs


def _strides(shape: list) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _assemble(header: dict, buffer: torch.Tensor, offsets: list, specs: list) -> dict:
    """The state dict: each tensor a view of ``buffer`` at its offset (copied when the
    offset does not suit its dtype).

    One typed alias of the buffer's storage per dtype, and one ``as_strided`` per tensor:
    slicing and re-viewing each tensor costs several times more for parts of thousands.
    """
    storage, start = buffer.untyped_storage(), buffer.storage_offset()
    address = buffer.data_ptr()
    typed: dict[str, torch.Tensor] = {}
    tensors = []
    for (dtype, shape, nbytes), offset in zip(specs, offsets):
        size = _ELEMENT_SIZE[dtype]
        if (address + offset) % size:
            raw = buffer[offset:offset + nbytes].clone()
            tensors.append(raw.view(getattr(torch, dtype)).view(shape))
            continue
        alias = typed.get(dtype)
        if alias is None:
            alias = typed[dtype] = torch.empty(0, dtype=getattr(torch, dtype)).set_(
                storage, 0, (0,))
        tensors.append(alias.as_strided(shape, _strides(shape), (start + offset) // size))
    return protocol.fill_skeleton(protocol.unpack_value(header["skeleton"]), tensors)


def _best_shift(offsets: list, specs: list) -> int:
    """Where in the buffer a version 1 part starts (0..7) so that most bytes are viewable."""
    def aligned(shift: int) -> int:
        return sum(n for (dtype, _, n), o in zip(specs, offsets)
                   if (shift + o) % _ELEMENT_SIZE[dtype] == 0)
    return max(range(8), key=lambda shift: (aligned(shift), -shift))


def _fresh_buffer(size: int, shift: int) -> torch.Tensor:
    """Fresh memory: ``size`` bytes and a page (room for a direct read's whole last page),
    starting ``shift`` bytes after a page boundary."""
    whole = torch.empty(size + 2 * PAGE, dtype=torch.uint8)
    start = aligned_start(whole.data_ptr()) + shift
    return whole[start:start + size + PAGE]


def _parse(path: str, read, check: bool) -> tuple[dict, int, list, list, int]:
    """Header, its length, tensor specs and offsets, and the file size they describe."""
    try:
        header, data_offset = protocol.read_part_header(read)
        specs = _tensor_specs(path, header)
    except (protocol.ProtocolError, ValueError) as exc:
        if check:
            verify_file(path)  # corruption is reported as such, not as a malformed part
        raise ValueError(f"{path}: {getattr(exc, 'message', exc)}") from None
    offsets, size = protocol.part_layout(header["version"], data_offset, [n for *_, n in specs])
    return header, data_offset, specs, offsets, size


def read_part(path: str) -> tuple[dict, dict]:
    """Read a local-checkpoint part in one pass, checking its checksum on the way.

    Parameters
    ----------
    path : str
        The part file (its checksum record ``<path>.ckptd-sum`` beside it).

    Returns
    -------
    (state_dict, header)
        Tensors are CPU tensors backed by one fresh buffer; nothing is unpickled.

    Raises
    ------
    ChecksumMismatchError
        If the part does not match the checksum recorded beside it.
    ValueError
        If the part is malformed (bad header, unknown dtype, truncated).
    """
    expected = read_sidecar(path)
    with open(path, "rb", buffering=0) as f:
        fd, consumed = f.fileno(), [0]

        def read(n: int) -> bytes:
            data = os.pread(fd, n, consumed[0])
            consumed[0] += len(data)
            return data

        header, _, specs, offsets, size = _parse(path, read, check=True)
        actual = os.fstat(fd).st_size
        if actual != size:
            verify_file(path)
            raise ValueError(f"{path} has {actual} bytes, its header describes {size}: "
                             "truncated or extended")
        direct = header["version"] >= 2 and direct_reads_for(fd, path)
        shift = 0 if header["version"] >= 2 else _best_shift(offsets, specs)
        buffer = _fresh_buffer(size, shift)
        view = memoryview(buffer.numpy())
        got = read_file_into(fd, view, size, expected.algorithm, direct, path)
    check_matches(path, got, expected)
    return _assemble(header, buffer, offsets, specs), header


def read_resident(pool: torch.Tensor, resident: dict, where: str) -> tuple[dict, dict]:
    """Copy a part the daemon keeps in its staging pool, checking it on the way.

    Parameters
    ----------
    pool : torch.Tensor
        The daemon's staging pool, mapped (``DaemonConnection.pool``).
    resident : dict
        ``items`` (``[pool offset, nbytes]`` of the header and each tensor, in part order),
        ``crc``, ``size`` and ``algorithm`` of the part file as the daemon's writer
        recorded them, as the daemon's inventory reports them.
    where : str
        What to call the part in errors.

    Raises
    ------
    ChecksumMismatchError
        If the copy does not have the recorded checksum (the memory changed): load it
        from disk instead.
    ValueError
        If the header is malformed.
    """
    items = [(int(o), int(n)) for o, n in resident["items"]]
    base = items[0][0]
    span = max(o + n for o, n in items) - base
    if base < 0 or span < 0 or base + span > pool.numel():
        raise ChecksumMismatchError(f"{where}: the daemon's memory tier names bytes outside "
                                    "its pool")
    algorithm = resident.get("algorithm", "crc32")
    # The copy keeps the pool's alignment (extents start on pages), so every tensor the
    # extent holds in place for its dtype is in place in the copy too.
    buffer = _fresh_buffer(span, 0)
    view = memoryview(buffer.numpy())
    version = protocol.part_version(bytes(pool[base:base + 8].numpy()))
    got = copy_into(buffer.data_ptr(), pool.data_ptr() + base, view, span,
                    algorithm if version >= 2 else None)
    if version < 2:  # the file was the items back to back: checksum those, not the gaps
        update, crc = algorithm_named(algorithm).update, 0
        for offset, nbytes in items:
            crc = update(view[offset - base:offset - base + nbytes], crc)
        got = Checksum(crc, sum(n for _, n in items), algorithm)
    if (got.value, got.size) != (int(resident["crc"]), int(resident["size"])):
        raise ChecksumMismatchError(f"{where}: the copy from the daemon's memory has {algorithm} "
                                    f"{got.value:08x} over {got.size} bytes, "
                                    f"{int(resident['crc']):08x} over {resident['size']} was "
                                    "recorded; it changed")
    try:
        header, _ = protocol.decode_part_header(bytes(view[:items[0][1]]))
        specs = _tensor_specs(where, header)
    except protocol.ProtocolError as exc:
        raise ValueError(f"{where}: {exc.message}") from None
    if len(specs) != len(items) - 1:
        raise ValueError(f"{where}: the header describes {len(specs)} tensors, the daemon "
                         f"holds {len(items) - 1}")
    return _assemble(header, buffer, [o - base for o, _ in items[1:]], specs), header
