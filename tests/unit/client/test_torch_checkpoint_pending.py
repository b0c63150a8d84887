"""``TorchAsyncCheckpoint.get_num_unfinalized_calls``: what the framework adapters read
instead of the checkpoint's internal queue."""

import os

import torch

from ckpt_client import TorchAsyncCheckpoint


def test_saves_count_until_finalized(daemon):
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    assert checkpoint.get_num_unfinalized_calls() == 0
    for step in range(2):
        checkpoint.async_save({"w": torch.full((8,), float(step))},
                              os.path.join(daemon.roots[0], f"step{step}.pt"))
    assert checkpoint.get_num_unfinalized_calls() == 2  # durable or not: not finalized yet
    checkpoint.finalize_async_save(blocking=True)
    assert checkpoint.get_num_unfinalized_calls() == 0
    checkpoint.close()


def test_an_aborted_save_is_no_longer_counted(daemon):
    checkpoint = TorchAsyncCheckpoint(socket=daemon.socket)
    checkpoint.async_save({"w": torch.ones(8)}, os.path.join(daemon.roots[0], "dropped.pt"))
    checkpoint.close(abort=True)
    assert checkpoint.get_num_unfinalized_calls() == 0
