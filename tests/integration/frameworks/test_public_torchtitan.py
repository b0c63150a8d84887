"""torchtitan's own checkpoint-manager expectations, against ``CkptdCheckpointManager``.

Each test re-states what one or more of torchtitan's unit tests expect of its
``CheckpointManager`` (``tests/unit_tests/test_checkpoint.py``, ``TestCheckpointManager``,
at the commit of the 0.3 release the ``[torchtitan]`` extra installs) and checks it of
our subclass. Upstream replaces ``dcp.save`` / ``dcp.load`` and the process group by
mocks; here everything is real: a one-rank gloo group, torchtitan's own optimizer and
scheduler containers, a real daemon writing the files and stock ``dcp.load`` reading
them.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")

import torch.distributed as dist  # noqa: E402
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402

from conftest import wait_for  # noqa: E402
from frameworks_common import assert_same  # noqa: E402


@pytest.fixture
def one_rank(tmp_path):
    """A one-rank gloo group (torchtitan asks for the rank before it purges)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


class Run:
    """A model with a non-persistent buffer, torchtitan's AdamW and scheduler containers,
    a train-state tensor, and managers built on them."""

    def __init__(self, daemon, base: str) -> None:
        from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
        from torchtitan.components.optimizer.optimizer import (OptimizersContainer,
                                                               ParamGroupConfig)

        self.daemon, self.base = daemon, base
        torch.manual_seed(0)
        self.model = torch.nn.Linear(16, 8)
        # a buffer the model does not persist (rotary tables, say) must not be saved
        self.model.register_buffer("scratch", torch.randn(4), persistent=False)
        self.optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2})]).build(
            model_parts=[self.model])
        self.schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
            optimizers=self.optimizers, training_steps=20)
        self.trainer = torch.tensor([1.2347])
        self.managers: list = []

    def manager(self, **config):
        from ckpt_client.integrations.torchtitan import CkptdCheckpointManager

        fields = dict(enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
                      async_mode="disabled", socket=self.daemon.socket)
        fields.update(config)
        manager = CkptdCheckpointManager.Config(**fields).build(
            dataloader=None, model_parts=[self.model], optimizers=self.optimizers,
            lr_schedulers=self.schedulers, states={"trainer": self.trainer},
            sd_adapter=None, base_folder=self.base)
        self.managers.append(manager)
        return manager

    def step(self) -> None:
        self.model(torch.randn(4, 16)).square().mean().backward()
        self.optimizers.step()
        self.schedulers.step()
        self.optimizers.zero_grad()

    def state(self) -> dict:
        return {k: v.clone() for k, v in self.model.state_dict().items()}

    def scramble(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(1.0)
        self.trainer.fill_(42.0)

    def folder(self) -> str:
        return os.path.join(self.base, "checkpoint")

    def keys(self, step: int) -> set[str]:
        """The keys stock DCP finds in ``step-N``'s ``.metadata``."""
        path = os.path.join(self.folder(), f"step-{step}")
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)

    def close(self) -> None:
        for manager in self.managers:
            manager.close()


@pytest.fixture
def run(shared_daemon, one_rank, request):
    run = Run(shared_daemon, os.path.join(shared_daemon.roots[0], request.node.name))
    run.step()
    yield run
    run.close()


def test_save_then_load_restores_model_optimizer_and_states(run):
    """Mirrors ``test_save_load_restores_state``: what ``load(step=N)`` brings back is
    what ``save(curr_step=N)`` saved; also ``test_load_finds_latest_and_calls_dcp_load``
    (``load(step=-1)`` takes the newest step with a ``.metadata``)."""
    manager = run.manager()
    assert manager.save(curr_step=1)
    model, optim = run.state(), run.optimizers.state_dict()
    run.step()
    assert manager.save(curr_step=2)
    newest = run.state()
    run.scramble()
    assert manager.load(step=1)
    assert_same(run.state(), model)
    assert_same(run.optimizers.state_dict(), optim)
    assert run.trainer.item() == pytest.approx(1.2347)
    run.scramble()
    assert manager.load(step=-1)
    assert_same(run.state(), newest)


def test_load_without_checkpoints_and_a_missing_step(run):
    """Mirrors ``test_load_returns_false_when_no_checkpoint_folder`` and
    ``test_explicit_load_step_raises_when_checkpoint_step_missing`` /
    ``..._folder_missing``: a fresh start loads nothing; an explicit step that does not
    exist is a ``FileNotFoundError`` naming ``--checkpoint.load_step``."""
    manager = run.manager()
    assert manager.load(step=-1) is False
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
        manager.load(step=5)  # no checkpoint folder yet
    assert manager.save(curr_step=1)
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5"):
        manager.load(step=5)  # the folder exists, step-5 does not


def test_keep_latest_k_purges_the_oldest_steps(run):
    """Mirrors ``test_save_and_purge_keeps_last_k_checkpoints``: with ``keep_latest_k=2``
    three saves leave ``step-2`` and ``step-3``, and the newest holds the state."""
    manager = run.manager(keep_latest_k=2)
    for step in (1, 2, 3):
        assert manager.save(curr_step=step)
    folder = run.folder()
    wait_for(lambda: sorted(os.listdir(folder)) == ["step-2", "step-3"], 30,
             f"torchtitan's purge thread to leave step-2 and step-3 in {folder}")
    assert "trainer" in run.keys(3) and any(k.startswith("optimizer") for k in run.keys(3))


def test_interval_first_step_last_step_and_load_only(run):
    """Mirrors ``test_interval_respects_interval``, ``test_enable_first_step_checkpoint``
    and ``test_load_only_prevents_saving``: saves happen on interval multiples, on the
    first step when asked, on the last step always, and never with ``load_only``."""
    manager = run.manager(interval=3)
    saved = [step for step, last in [(1, False), (2, False), (2, True), (3, False),
                                     (4, False), (4, True)] if manager.save(step, last)]
    assert saved == [2, 3, 4]
    assert sorted(os.listdir(run.folder())) == ["step-2", "step-3", "step-4"]

    first = run.manager(interval=10, enable_first_step_checkpoint=True, folder="first")
    assert [s for s in (1, 2, 10) if first.save(curr_step=s)] == [1, 10]
    load_only = run.manager(load_only=True, folder="never")
    assert not any(load_only.save(curr_step=s, last_step=s == 10) for s in (1, 5, 10))
    assert not os.path.exists(os.path.join(run.base, "never"))


def test_model_keys_unprefixed_last_step_model_only_and_no_transient_buffers(run):
    """Mirrors ``test_verify_prefix``, ``test_last_save_model_only_and_initial_load_model_only``
    and ``test_non_persist_buffer_not_saved``: model keys are saved without a ``model``
    prefix, a regular save holds the optimizer, the last-step save with
    ``last_save_model_only`` holds the model alone (in ``export_dtype``), and a
    non-persistent buffer is never saved."""
    manager = run.manager(last_save_model_only=True, export_dtype="bfloat16")
    assert manager.save(curr_step=1)
    assert manager.save(curr_step=2, last_step=True)
    regular, last = run.keys(1), run.keys(2)
    assert {"weight", "bias"} <= regular and not any(k.startswith("model") for k in regular)
    assert any(k.startswith("optimizer") for k in regular) and "trainer" in regular
    assert last == {"weight", "bias"}
    assert "scratch" not in regular | last
    metadata = FileSystemReader(os.path.join(run.folder(), "step-2")).read_metadata()
    assert metadata.state_dict_metadata["weight"].properties.dtype == torch.bfloat16


def test_pinned_mem_mode_keeps_a_staging_future_until_waited(run):
    """Mirrors ``test_async_save_with_pinned_mem_assigns_staging_future``: in
    ``async_with_pinned_mem`` a save leaves ``staging_future`` set,
    ``maybe_wait_for_staging`` waits on it and clears it; after that wait the trainer may
    change its tensors and the checkpoint still holds the saved values."""
    manager = run.manager(async_mode="async_with_pinned_mem")
    assert manager.staging_future is None
    expected = run.state()
    assert manager.save(curr_step=1)
    assert manager.staging_future is not None and manager.save_future is not None
    manager.maybe_wait_for_staging()
    assert manager.staging_future is None
    run.scramble()
    manager.maybe_wait_for_saving()
    loaded = {k: torch.zeros_like(v) for k, v in expected.items()}
    torch.distributed.checkpoint.load(
        loaded, storage_reader=FileSystemReader(os.path.join(run.folder(), "step-1")))
    assert_same(loaded, expected)


def test_async_mode_waits_for_the_previous_save_first(run):
    """Mirrors ``test_async_save_calls_maybe_wait_for_saving``: in ``async`` mode a save
    first waits for the one before it, then holds its own future."""
    manager = run.manager(async_mode="async")
    assert manager.save(curr_step=10)
    first = manager.save_future
    assert first is not None
    assert manager.save(curr_step=20)
    assert first.done() and first.exception() is None
    assert manager.save_future is not first
    manager.maybe_wait_for_saving()
    assert sorted(os.listdir(run.folder())) == ["step-10", "step-20"]
    assert all(os.path.exists(os.path.join(run.folder(), n, ".metadata"))
               for n in ("step-10", "step-20"))


def test_disabled_manager_waits_are_no_ops(run):
    """Mirrors ``test_maybe_wait_for_staging_when_checkpoint_disabled`` and
    ``test_maybe_wait_for_saving_when_checkpoint_disabled``."""
    manager = run.manager(enable=False)
    manager.maybe_wait_for_staging()
    manager.maybe_wait_for_saving()
    assert not manager.save(curr_step=1, last_step=True)
