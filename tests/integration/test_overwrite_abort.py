"""A save over an existing file that does not complete leaves the previous file in place.

The writer renames the new file over the old one as soon as the new one is durable; an
abort (the trainer asks, or dies) that arrives while that write is under way must not
remove the file then: the previous checkpoint would be gone with it. Every test pauses the
daemon's writers (SIGSTOP) so the abort lands while the job is queued at a writer, lets
them go, waits until the daemon has settled the save (its staging extent is free only
after its writers answered), and then reads the path with stock ``torch.load``.
"""

import os
import subprocess
import sys

import torch

from conftest import wait_for
from faults import writers_paused
from ckpt_client import TorchAsyncCheckpoint
from ckptd.checksum import verify_file


def phases(daemon) -> list[str]:
    return [r["phase"] for r in daemon.status()["requests"]]


def settled(daemon) -> bool:
    status = daemon.status()
    return status["pool"]["used_bytes"] == 0 and all(w["jobs"] == 0 for w in status["writers"])


def assert_only_the_file_and_its_record(path):
    assert sorted(os.listdir(os.path.dirname(path))) == sorted(
        [os.path.basename(path), os.path.basename(path) + ".ckptd-sum"]), \
        "nothing hidden may be left beside the checkpoint"


def test_an_overwrite_leaves_only_the_new_file(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "last.pt")
    checkpoint = TorchAsyncCheckpoint()
    for value in (1.0, 2.0):
        checkpoint.async_save({"w": torch.full((1 << 16,), value)}, path)
        checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((1 << 16,), 2.0))
    verify_file(path)
    assert_only_the_file_and_its_record(path)
    checkpoint.close()


def test_an_aborted_overwrite_keeps_the_previous_file(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "last.pt")
    old, new = torch.full((1 << 16,), 1.0), torch.full((1 << 16,), 2.0)
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": old}, path)
    checkpoint.finalize_async_save(blocking=True)
    with writers_paused(daemon):
        checkpoint.async_save({"w": new}, path)
        wait_for(lambda: phases(daemon)[-1:] == ["writing"], 30, "the overwrite to be at a writer")
        checkpoint.close(abort=True)
        wait_for(lambda: phases(daemon)[-1:] == ["aborted"], 30, "the daemon to abort it")
    wait_for(lambda: settled(daemon), 60, "the aborted save's writer to answer")
    assert torch.equal(torch.load(path, weights_only=True)["w"], old)
    verify_file(path)  # the record beside it is the old file's too
    assert_only_the_file_and_its_record(path)
    # The queue works again, and the next save replaces the file as usual.
    checkpoint.async_save({"w": new}, path)
    checkpoint.finalize_async_save(blocking=True)
    assert torch.equal(torch.load(path, weights_only=True)["w"], new)
    verify_file(path)
    checkpoint.close()


TRAINER = """
import sys, torch
from ckpt_client import async_torch_save
request = async_torch_save({"w": torch.full((1 << 16,), 2.0)}, sys.argv[1])
print("staged", flush=True)
sys.stdin.read()
"""


def test_a_trainer_killed_during_an_overwrite_leaves_the_previous_file(daemon, monkeypatch):
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    path = os.path.join(daemon.roots[0], "last.pt")
    checkpoint = TorchAsyncCheckpoint()
    checkpoint.async_save({"w": torch.full((1 << 16,), 1.0)}, path)
    checkpoint.finalize_async_save(blocking=True)
    checkpoint.close()
    with writers_paused(daemon):
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER, path], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE,
                                   env={**os.environ, "CKPTD_SOCKET": daemon.socket})
        assert trainer.stdout.readline().strip() == b"staged"
        trainer.kill()
        trainer.wait()
        wait_for(lambda: phases(daemon)[-1:] == ["aborted"], 30,
                 "the daemon to abort the killed trainer's save")
    wait_for(lambda: settled(daemon), 60, "the aborted save's writer to answer")
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((1 << 16,), 1.0))
    verify_file(path)
    assert_only_the_file_and_its_record(path)
