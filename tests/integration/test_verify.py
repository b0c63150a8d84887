"""Corrupted parts are detected by checksum and never loaded silently."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as DCP

from ckpt_client import AsyncCallsQueue, dcp


def load_refused(directory, needle):
    """DCP wraps reader errors in its own CheckpointException (a BaseException)."""
    with pytest.raises(BaseException) as info:
        DCP.load({"w": torch.zeros(4096), "step": 0},
                 storage_reader=dcp.VerifyingFileSystemReader(directory))
    text = str(info.value)
    assert "is corrupted" in text and needle in text, text


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.fixture
def saved_checkpoint(shared_daemon, monkeypatch, tmp_path):
    monkeypatch.setenv("CKPTD_SOCKET", shared_daemon.socket)
    directory = os.path.join(shared_daemon.roots[0], tmp_path.name)
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.async_save({"w": torch.arange(4096.0), "step": 9}, directory))
    queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    return directory


def test_intact_checkpoint_loads_through_the_verifying_reader(saved_checkpoint):
    loaded = {"w": torch.zeros(4096), "step": 0}
    DCP.load(loaded, storage_reader=dcp.VerifyingFileSystemReader(saved_checkpoint))
    assert torch.equal(loaded["w"], torch.arange(4096.0)) and loaded["step"] == 9
    assert len(dcp.verify_checkpoint(saved_checkpoint)) >= 2


def test_a_flipped_byte_in_a_part_is_refused_by_reader_and_cli(saved_checkpoint):
    part = next(os.path.join(saved_checkpoint, n) for n in sorted(os.listdir(saved_checkpoint))
                if n.endswith(".distcp") and os.path.getsize(os.path.join(saved_checkpoint, n)) > 4096)
    flip_byte(part, os.path.getsize(part) // 2)
    load_refused(saved_checkpoint, os.path.basename(part))
    result = subprocess.run([sys.executable, "-m", "ckptd", "verify", saved_checkpoint],
                            capture_output=True, text=True)
    assert result.returncode == 1 and "corrupted" in result.stderr and os.path.basename(part) in result.stderr


def test_a_corrupted_metadata_file_is_refused_before_unpickling(saved_checkpoint):
    flip_byte(os.path.join(saved_checkpoint, ".metadata"), 10)
    load_refused(saved_checkpoint, ".metadata")
