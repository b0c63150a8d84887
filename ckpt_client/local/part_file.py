"""Reading a local-checkpoint part into tensors: from its file, or from the daemon's memory.

A part is a msgpack header (:func:`ckptd.protocol.decode_part_header`) followed by the raw
bytes of its tensors; nothing is unpickled. Either way the bytes are copied once, into
one fresh buffer, and every tensor is a view of it (a tensor whose offset does not suit
its dtype is copied out alone).

The copy runs in pieces of :data:`PIECE_BYTES` on a few threads (reads, ``copy_`` and
the CRCs all release the GIL); a piece's CRC, in the algorithm its record names, is
computed by the thread that just copied it, while it is hot, and the pieces' CRCs are
folded in order (:func:`ckptd.checksum.crc32_combine`):

- :func:`read_part` reads the file. When the daemon verified this very file (same size,
  modification time and inode as it checked), its bytes are not checksummed again: that
  is what lets a rank read its own part at the disk's raw rate. Otherwise the crc32 is
  compared with the record beside the file at the end;
- :func:`read_resident` copies a part the daemon keeps in its staging pool (the memory
  tier) and checks the copy against the crc32 the daemon's writer recorded: shared
  memory that changed (reused for another save, or scribbled on) is never loaded.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ckptd import protocol
from ckptd.checksum import (ALGORITHM, Checksum, ChecksumMismatchError, algorithm_named,
                            check_matches, crc32_combine, read_sidecar, verify_file)

#: Bytes each worker reads or copies (and checksums) at a time.
PIECE_BYTES = 16 << 20
_ELEMENT_SIZE = {name: (torch.empty(0, dtype=getattr(torch, name)).element_size()
                        if hasattr(torch, name) else 1) for name in protocol.BUFFER_DTYPES}


def _in_pieces(total: int, piece) -> list:
    """Run ``piece(start, end)`` over ``[0, total)`` in :data:`PIECE_BYTES` pieces on a few
    threads; returns each piece's result, in order."""
    bounds = [(start, min(start + PIECE_BYTES, total)) for start in range(0, total, PIECE_BYTES)]
    if len(bounds) <= 1:
        return [piece(start, end) for start, end in bounds]
    workers = max(1, min(4, os.cpu_count() or 2, len(bounds)))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ckpt-load") as pool:
        return list(pool.map(lambda b: piece(*b), bounds))


def _crc_of(views, algorithm: str = ALGORITHM) -> tuple[int, int]:
    """(crc, length) of consecutive views taken as one run."""
    update = algorithm_named(algorithm).update
    crc, length = 0, 0
    for view in views:
        crc = update(view, crc)
        length += len(view)
    return crc, length


def _fold(first: tuple[int, int], pieces: list, algorithm: str = ALGORITHM) -> tuple[int, int]:
    """The crc and length of ``first`` followed by every ``(crc, length)`` piece."""
    crc, size = first
    for piece_crc, length in pieces:
        crc = crc32_combine(crc, piece_crc, length, algorithm)
        size += length
    return crc, size


def identity_of(fd: int) -> list:
    """``[size, mtime_ns, inode]``: what the daemon's verification of a file is keyed by."""
    info = os.fstat(fd)
    return [info.st_size, info.st_mtime_ns, info.st_ino]


def _tensor_specs(path: str, header: dict) -> list:
    specs = []
    for dtype, shape, nbytes in header["buffers"]:
        if dtype not in protocol.BUFFER_DTYPES or dtype == "bytes":
            raise ValueError(f"{path}: buffer dtype {dtype!r} is not a tensor dtype")
        specs.append((dtype, shape, int(nbytes)))
    return specs


def _assemble(header: dict, buffer: torch.Tensor, offsets: list, specs: list) -> dict:
    """The state dict: each tensor a view of ``buffer`` at its offset (copied when the
    offset does not suit its dtype)."""
    tensors = []
    for (dtype, shape, nbytes), offset in zip(specs, offsets):
        raw = buffer[offset:offset + nbytes]
        if offset % _ELEMENT_SIZE[dtype]:
            raw = raw.clone()
        tensors.append(raw.view(getattr(torch, dtype)).view(shape))
    return protocol.fill_skeleton(protocol.unpack_value(header["skeleton"]), tensors)


def _best_shift(offsets: list, specs: list) -> int:
    """Where in the buffer the payload starts (0..7) so that most bytes are viewable."""
    def aligned(shift: int) -> int:
        return sum(n for (dtype, _, n), o in zip(specs, offsets)
                   if (shift + o) % _ELEMENT_SIZE[dtype] == 0)
    return max(range(8), key=lambda shift: (aligned(shift), -shift))


def read_part(path: str, trusted: list | None = None) -> tuple[dict, dict]:
    """Read a local-checkpoint part in one pass.

    Parameters
    ----------
    path : str
        The part file.
    trusted : list, optional
        ``[size, mtime_ns, inode]`` of the file as the daemon verified it. When the open
        file still has exactly this identity, its bytes are not checksummed again.

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
    with open(path, "rb", buffering=0) as f:
        fd = f.fileno()
        identity = identity_of(fd)  # [size, mtime_ns, inode], as it is open now
        check = trusted is None or identity != list(trusted)
        expected = read_sidecar(path) if check else None
        consumed: list = []

        def read(n: int) -> bytes:
            data = os.pread(fd, n, sum(map(len, consumed)))
            consumed.append(data)
            return data

        try:
            header, data_offset = protocol.read_part_header(read)
            prefix = b"".join(consumed)[:data_offset]
            specs = _tensor_specs(path, header)
        except (protocol.ProtocolError, ValueError) as exc:
            if check:
                verify_file(path)  # corruption is reported as such, not as a malformed part
            raise ValueError(f"{path}: {getattr(exc, 'message', exc)}") from None
        offsets, total = [], 0
        for _, _, nbytes in specs:
            offsets.append(total)
            total += nbytes
        size = identity[0]
        if size != data_offset + total:
            if check:
                verify_file(path)
            raise ValueError(f"{path} has {size - data_offset} bytes of tensors, its header "
                             f"describes {total}: truncated or extended")
        shift = _best_shift(offsets, specs)
        buffer = torch.empty(shift + total, dtype=torch.uint8)
        view = memoryview(buffer.numpy())[shift:]

        def read_piece(start: int, end: int):
            done = start
            while done < end:
                got = os.preadv(fd, [view[done:end]], data_offset + done)
                if got <= 0:
                    raise ValueError(f"{path} is truncated at byte {data_offset + done}")
                done += got
            return _crc_of([view[start:end]], expected.algorithm) if check else None

        pieces = _in_pieces(total, read_piece)
    if check:
        crc, size = _fold(_crc_of([prefix[:data_offset]], expected.algorithm), pieces,
                          expected.algorithm)
        check_matches(path, Checksum(crc, size, expected.algorithm), expected)
    return _assemble(header, buffer, [shift + o for o in offsets], specs), header


def read_resident(pool: torch.Tensor, resident: dict, where: str) -> tuple[dict, dict]:
    """Copy a part the daemon keeps in its staging pool, checking it on the way.

    Parameters
    ----------
    pool : torch.Tensor
        The daemon's staging pool, mapped (``DaemonConnection.pool``).
    resident : dict
        ``items`` (``[pool offset, nbytes]`` of the header and each tensor, in part order),
        ``crc`` and ``size`` of the part, as the daemon's inventory reports them.
    where : str
        What to call the part in errors.

    Raises
    ------
    ChecksumMismatchError
        If the copy does not have the recorded crc32 (the memory changed): load it from
        disk instead.
    ValueError
        If the header is malformed.
    """
    items = [(int(o), int(n)) for o, n in resident["items"]]
    base = items[0][0]
    span = items[-1][0] + items[-1][1] - base
    if base < 0 or span < 0 or base + span > pool.numel():
        raise ChecksumMismatchError(f"{where}: the daemon's memory tier names bytes outside "
                                    "its pool")
    buffer = torch.empty(span, dtype=torch.uint8)
    copy, source = memoryview(buffer.numpy()), pool[base:base + span]
    algorithm = resident.get("algorithm", ALGORITHM)

    def copy_piece(start: int, end: int) -> tuple[int, int]:
        buffer[start:end].copy_(source[start:end])
        # checksum the part's bytes of this piece, not the alignment gaps between them
        return _crc_of([copy[max(o - base, start):min(o - base + n, end)] for o, n in items
                        if max(o - base, start) < min(o - base + n, end)], algorithm)

    value, size = _fold((0, 0), _in_pieces(span, copy_piece), algorithm)
    if (value, size) != (int(resident["crc"]), int(resident["size"])):
        raise ChecksumMismatchError(f"{where}: the copy from the daemon's memory has {algorithm} "
                                    f"{value:08x} over {size} bytes, {int(resident['crc']):08x} "
                                    f"over {resident['size']} was recorded; it changed")
    header_bytes = bytes(copy[:items[0][1]])
    try:
        header, _ = protocol.decode_part_header(header_bytes)
        specs = _tensor_specs(where, header)
    except protocol.ProtocolError as exc:
        raise ValueError(f"{where}: {exc.message}") from None
    if len(specs) != len(items) - 1:
        raise ValueError(f"{where}: the header describes {len(specs)} tensors, the daemon "
                         f"holds {len(items) - 1}")
    return _assemble(header, buffer, [o - base for o, _ in items[1:]], specs), header
