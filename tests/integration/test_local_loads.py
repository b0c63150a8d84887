"""Loads of local parts end to end, one real daemon, one process: every read path checks
every byte (a byte that rots on disk after the daemon verified the file, memory of the
memory tier scribbled on), and parts in the version 1 layout (tensors back to back, what
trainers wrote before) still load from memory and from disk, bit-equal."""

from __future__ import annotations

import functools
import os

import pytest
import torch

from ckptd import protocol
from ckptd.checksum import ChecksumMismatchError

from test_local_checkpoints import same, state_of


def odd_state(iteration: int) -> dict:
    """state_of plus odd sizes and dtypes, a zero-size tensor, and tensors that end on
    and just past a 4 KiB boundary."""
    state = state_of(0, iteration, big_mib=1, small_tensors=20)
    g = torch.Generator().manual_seed(iteration)
    state["odd"] = {"u8": torch.randint(0, 255, (4093,), dtype=torch.uint8, generator=g),
                    "page": torch.randn(1024, generator=g), "past": torch.ones(4097, dtype=torch.int8),
                    "f16": torch.randn(3, 77, generator=g).to(torch.float16),
                    "zero": torch.empty(0, dtype=torch.float64), "flags": torch.rand(9) > 0.5}
    return state


def manager_for(daemon, local_dir):
    from ckpt_client import LocalCheckpointManager

    return LocalCheckpointManager(local_dir / "ckpt", socket=daemon.socket)


def save(daemon, local_dir, iteration: int) -> dict:
    from ckpt_client import BasicTensorAwareStateDict

    state = odd_state(iteration)
    manager_for(daemon, local_dir).save(BasicTensorAwareStateDict(state), iteration)
    return state


def load(daemon, local_dir):
    manager = manager_for(daemon, local_dir)
    manager.find_latest()
    loaded, _ = manager.load()
    return manager, loaded.state_dict


def flip_keeping_identity(path) -> None:
    """Flip a byte in the middle of a file as a failing disk does: size, mtime and inode
    stay what the daemon verified."""
    info = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(info.st_size // 2)
        byte = f.read(1)
        f.seek(info.st_size // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def test_a_byte_rotted_on_disk_after_the_daemon_verified_the_part_is_never_loaded(
        start_daemon, tmp_path):
    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)],
                          env={"CKPTD_MEMORY_TIER": "0"})  # every load reads the disk
    state = save(daemon, local_dir, 3)
    manager, loaded = load(daemon, local_dir)
    assert manager.last_load_report["source"] == "local_disk" and same(loaded, state)
    part = manager._found.own_parts[0]
    assert part.verified and part.identity  # the daemon vouches for this very file
    flip_keeping_identity(part.path)
    manager = manager_for(daemon, local_dir)
    assert manager.find_latest() == 3  # still the file the daemon verified, it says
    with pytest.raises(ChecksumMismatchError, match="rank 0, iteration 3"):
        manager.load()


def test_scribbled_memory_tier_falls_back_to_the_disk_and_both_bad_is_an_error(start_daemon,
                                                                               tmp_path):
    from ckpt_client import connect

    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    state = save(daemon, local_dir, 5)
    manager, loaded = load(daemon, local_dir)
    assert manager.last_load_report["source"] == "daemon_memory" and same(loaded, state)
    resident = manager._found.own_parts[0].resident
    offset, nbytes = resident["items"][1]  # the first tensor's bytes in the shared pool
    pool = connect(daemon.socket).pool
    pool[offset + nbytes // 2] ^= 0x08
    manager, loaded = load(daemon, local_dir)
    assert manager.last_load_report["source"] == "local_disk" and same(loaded, state)
    flip_keeping_identity(manager._found.own_parts[0].path)
    with pytest.raises(ChecksumMismatchError):
        load(daemon, local_dir)


def test_a_version_1_part_still_loads_from_memory_and_from_disk(start_daemon, tmp_path,
                                                                monkeypatch):
    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    monkeypatch.setattr(protocol, "encode_part_header",  # a trainer of before: back to back
                        functools.partial(protocol.encode_part_header, version=1))
    state = save(daemon, local_dir, 7)
    monkeypatch.undo()
    manager, loaded = load(daemon, local_dir)
    assert manager.last_load_report["source"] == "daemon_memory" and same(loaded, state)
    path = manager._found.own_parts[0].path
    with open(path, "rb") as f:
        prefix = f.read(16)
    header_len = int.from_bytes(prefix[8:16], "little") + 16
    assert protocol.part_version(prefix) == 1
    assert os.path.getsize(path) == header_len + sum(t.numel() * t.element_size() for t in
                                                     _tensors(state))
    daemon.stop()
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])  # its memory is gone
    manager, loaded = load(daemon, local_dir)
    assert manager.last_load_report["source"] == "local_disk" and same(loaded, state)


def test_a_version_2_part_file_mirrors_the_extent_with_zeroed_gaps(start_daemon, tmp_path):
    local_dir = tmp_path / "node"
    daemon = start_daemon(extra_args=["--local-dir", str(local_dir)])
    for iteration in (1, 2):  # the second save may reuse pool bytes the first dirtied
        state = save(daemon, local_dir, iteration)
    manager, _ = load(daemon, local_dir)
    data = open(manager._found.own_parts[0].path, "rb").read()
    header, data_offset = protocol.decode_part_header(data)
    tensors = _tensors(state)
    offsets, size = protocol.part_layout(2, data_offset, [t.numel() * t.element_size()
                                                          for t in tensors])
    assert header["version"] == 2 and len(data) == size
    covered = bytearray(size)
    covered[:data_offset] = b"\x01" * data_offset
    for offset, tensor in zip(offsets, tensors):
        nbytes = tensor.numel() * tensor.element_size()
        assert data[offset:offset + nbytes] == tensor.contiguous().view(-1).view(
            torch.uint8).numpy().tobytes()
        covered[offset:offset + nbytes] = b"\x01" * nbytes
        if nbytes >= 64 * 1024:
            assert offset % 4096 == 0
    assert all(b == 0 for b, c in zip(data, covered) if not c)  # gaps are zeros


def _tensors(state) -> list:
    """Tensors in the order the part stores them (the flattening of a save)."""
    from ckpt_client.transport.flatten import flatten_state_dict

    return flatten_state_dict(state)[1]


def test_a_restarted_daemon_trusts_its_predecessors_note_and_the_load_still_catches_rot(
        start_daemon, tmp_path):
    """The daemon that wrote a part notes beside it that it verified that very file; its
    successor's first find_latest() takes the note instead of reading the part again, so
    a byte flipped keeping the file's identity goes unseen there, and the load, which
    checks every byte, refuses it. A file changed since the note (a new mtime) is read
    in full again and found corrupt."""
    from ckptd.checksum import VERIFIED_SUFFIX

    local_dir = tmp_path / "node"
    options = dict(extra_args=["--local-dir", str(local_dir)], env={"CKPTD_MEMORY_TIER": "0"})
    daemon = start_daemon(**options)
    save(daemon, local_dir, 3)
    path = str(local_dir / "ckpt" / "iter_0000003" / "rank_0.part")
    assert os.path.exists(path + VERIFIED_SUFFIX)
    daemon.stop()
    flip_keeping_identity(path)
    daemon = start_daemon(**options)
    manager = manager_for(daemon, local_dir)
    assert manager.find_latest() == 3  # the note vouched for the file: not read again
    with pytest.raises(ChecksumMismatchError, match="rank 0, iteration 3"):
        manager.load()
    daemon.stop()
    os.utime(path)  # the file changed since the note: it no longer vouches
    daemon = start_daemon(**options)
    assert manager_for(daemon, local_dir).find_latest() == -1
    assert not os.path.exists(path + VERIFIED_SUFFIX)
