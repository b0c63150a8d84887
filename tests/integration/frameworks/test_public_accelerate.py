"""Accelerate's own ``save_state`` / ``load_state`` expectations, through ckptd.

Each test re-states what one of Accelerate's tests expects
(``tests/test_state_checkpointing.py``, ``CheckpointTest``) and checks it of
:func:`ckpt_client.integrations.hf.save_state` / ``load_state``: the same tiny
``y = a * x + b`` model, Adam, shuffled data loaders, and the same resume and retention
checks, with the weights written by a real daemon (its checksum record beside them) and
the rest by Accelerate's own writer.
"""

from __future__ import annotations

import os
import random
import sys
import threading

import pytest
import torch

pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import ProjectConfiguration, set_seed  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ckpt_client.integrations.hf import load_state, save_state  # noqa: E402
from conftest import wait_for  # noqa: E402 - tests/conftest.py
from frameworks_common import writers_paused  # noqa: E402 - tests/integration/faults.py


class Line(torch.nn.Module):
    """``y = a * x + b``, as Accelerate's checkpointing tests train it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(1))
        self.b = torch.nn.Parameter(torch.randn(1))

    def forward(self, x):
        return x * self.a + self.b


def loader() -> DataLoader:
    x = torch.randn(16 * 4, 1)
    return DataLoader(TensorDataset(x, 2 * x + 3 + 0.1 * torch.randn(16 * 4, 1)),
                      shuffle=True, batch_size=16)


def train(epochs: int, model, data, optimizer, accelerator, scheduler=None) -> list[float]:
    """Train; one Python random draw per epoch (checks the RNG state is restored)."""
    draws = []
    for _ in range(epochs):
        for x, y in data:
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        draws.append(random.random())
        if scheduler is not None:
            scheduler.step()
    return draws


def prepared(directory: str, with_scheduler: bool = False, **project):
    """A fresh seeded model, Adam (and a scheduler), data, and an Accelerator saving
    under ``directory`` with automatic checkpoint naming."""
    set_seed(42)
    model = Line()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    parts = [model, optimizer, loader()]
    if with_scheduler:
        parts.append(torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99))
    accelerator = Accelerator(cpu=True, project_dir=directory, project_config=ProjectConfiguration(
        automatic_checkpoint_naming=True, **project))
    return (accelerator, *accelerator.prepare(*parts))


def values(model, optimizer) -> tuple:
    return model.a.item(), model.b.item(), optimizer.state_dict()


@pytest.fixture
def root(shared_daemon, monkeypatch, request):
    monkeypatch.setenv("CKPTD_SOCKET", shared_daemon.socket)
    return os.path.join(shared_daemon.roots[0], request.node.name)


def checkpoint(root: str, n: int) -> str:
    return os.path.join(root, "checkpoints", f"checkpoint_{n}")


def test_can_resume_training(root, shared_daemon):
    """Mirrors ``test_can_resume_training``: a run resumed from ``checkpoint_0`` and saved
    and reloaded midway ends exactly where the uninterrupted run ended, Adam state and
    Python RNG draws included. ``checkpoint_0`` is still being written (the daemon's
    writers held) when the second Accelerator of the process loads it: the load waits."""
    with writers_paused(shared_daemon):
        accelerator, model, optimizer, data = prepared(root)
        save_state(accelerator)
        initial = values(model, optimizer)
        truth_draws = train(3, model, data, optimizer, accelerator)
        truth = values(model, optimizer)
        accelerator, model, optimizer, data = prepared(root, iteration=1)
        assert not os.path.exists(os.path.join(checkpoint(root, 0), "pytorch_model.bin"))
    load_state(accelerator, checkpoint(root, 0))
    assert values(model, optimizer) == initial
    draws = train(2, model, data, optimizer, accelerator)
    save_state(accelerator)
    load_state(accelerator, checkpoint(root, 1))
    draws += train(1, model, data, optimizer, accelerator)
    assert values(model, optimizer) == truth
    assert draws == truth_draws
    assert os.path.exists(os.path.join(checkpoint(root, 1), "pytorch_model.bin.ckptd-sum"))



def waiting_on_a_pending_save(thread: threading.Thread) -> bool:
    """Whether ``thread`` is in the client queue's blocking wait with a save taken up
    (``call`` bound): a load that did not wait for that save would have read the missing
    weights and ended instead, so the writers can be let go without racing it."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None:
        if frame.f_code.co_name == "maybe_finalize_async_calls" and \
                frame.f_locals.get("call") is not None:
            return True
        frame = frame.f_back
    return False


def test_a_load_without_socket_waits_for_a_save_given_the_socket_path(root, shared_daemon):
    """A save handed over with the daemon's socket path spelled out and a load with
    ``socket=None`` (``CKPTD_SOCKET`` names the same daemon) share one queue: the load,
    started while the daemon's writers are held, waits until the weights are durable and
    then loads them, rather than reading a ``pytorch_model.bin`` not written yet."""
    outcome = {}

    def load(accelerator) -> None:
        try:
            load_state(accelerator, checkpoint(root, 0))
        except BaseException as exc:  # reported by the test thread below
            outcome["error"] = exc

    with writers_paused(shared_daemon):
        accelerator, model, optimizer, data = prepared(root)
        save_state(accelerator, socket=shared_daemon.socket)
        saved = values(model, optimizer)
        accelerator, model, optimizer, data = prepared(root, iteration=1)
        train(1, model, data, optimizer, accelerator)
        assert values(model, optimizer)[:2] != saved[:2]
        loader_thread = threading.Thread(target=load, args=(accelerator,), daemon=True)
        loader_thread.start()
        wait_for(lambda: not loader_thread.is_alive() or waiting_on_a_pending_save(loader_thread),
                 30, "load_state to wait for the save in flight or to end")
    loader_thread.join(60)
    assert not loader_thread.is_alive(), "load_state did not return once the writers resumed"
    assert "error" not in outcome, f"load_state did not wait for the save: {outcome['error']!r}"
    assert values(model, optimizer) == saved


def test_with_scheduler(root):
    """Mirrors ``test_with_scheduler``: the scheduler's state comes back."""
    accelerator, model, optimizer, data, scheduler = prepared(root, with_scheduler=True)
    save_state(accelerator)
    saved = scheduler.state_dict()
    train(3, model, data, optimizer, accelerator, scheduler)
    assert scheduler.state_dict() != saved
    load_state(accelerator, checkpoint(root, 0))
    assert scheduler.state_dict() == saved


def test_automatic_loading(root):
    """Mirrors ``test_automatic_loading``: ``load_state()`` with no directory loads the
    newest checkpoint of automatic naming."""
    accelerator, model, optimizer, data, scheduler = prepared(root, with_scheduler=True)
    save_state(accelerator)
    train(2, model, data, optimizer, accelerator, scheduler)
    at_save = (model.a.item(), model.b.item())
    save_state(accelerator)
    train(1, model, data, optimizer, accelerator, scheduler)
    assert (model.a.item(), model.b.item()) != at_save
    load_state(accelerator)
    assert (model.a.item(), model.b.item()) == at_save


def test_checkpoint_deletion_keeps_the_newest_total_limit(root):
    """Mirrors ``test_checkpoint_deletion`` and ``test_with_save_limit``: with
    ``total_limit=2``, eleven saves leave ``checkpoint_9`` and ``checkpoint_10``; the
    rotation never deleted a directory the daemon was writing, so every save succeeded
    and the newest weights are the model's, read by stock ``torch.load``."""
    accelerator, model, optimizer, data = prepared(root, total_limit=2)
    train(1, model, data, optimizer, accelerator)
    for _ in range(11):  # back to back, as upstream: each rotation meets a save in flight
        save_state(accelerator)
    load_state(accelerator)  # waits until the last save is durable, raising if one failed
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == \
        ["checkpoint_10", "checkpoint_9"]
    weights = torch.load(os.path.join(checkpoint(root, 10), "pytorch_model.bin"),
                         weights_only=True)
    assert torch.equal(weights["a"], model.a.detach()) and torch.equal(weights["b"], model.b.detach())
