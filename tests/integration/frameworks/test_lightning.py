"""Lightning with ``CkptdCheckpointIO``: real Trainer, real daemon, SIGKILL mid-save, resume.

A trainer saves every 2 steps (``ModelCheckpoint(save_top_k=2, save_last=True)``); while
the daemon is writing the save of step 6 (its writers paused) the trainer is SIGKILLed.
The save of step 6 must never look complete, ``last.ckpt`` must still be step 4's, the
``save_top_k`` rotation must have deleted only durable files, and
``Trainer.fit(ckpt_path="last")`` must restore exactly the model, optimizer and scheduler
state saved at step 4.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning", reason="the [lightning] extra is not installed")

from frameworks_common import KilledRun, assert_same, files_under, in_flight, wait_for  # noqa: E402


def test_killed_mid_save_resumes_from_last_exactly(daemon, tmp_path):
    ckpt = os.path.join(daemon.roots[0], "lightning")
    run = KilledRun(daemon, tmp_path, "lightning_run.py", ckpt)
    run.kill_mid_save(12)

    # step 6 never appeared; rotating step 2 out waited for step 6, so it is still there
    names = [n for n in files_under(ckpt) if not n.endswith(".ckptd-sum")]
    assert names == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "last.ckpt"], names
    last = torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=True)  # stock torch.load
    assert last["global_step"] == 4

    run.resume(8)
    assert_same(run.reference("resumed"), run.reference("step-4"))
    # the resumed run went on saving, and the top-2 rotation removed durable files only
    names = [n for n in files_under(ckpt) if not n.endswith(".ckptd-sum")]
    assert names == ["epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt"], names


def test_plugin_contract(daemon, tmp_path, monkeypatch):
    """Lightning's CheckpointIO expectations (its TorchCheckpointIO tests): save, load
    the same values, storage_options refused, remove; plus a clear refusal outside the
    daemon's roots."""
    from ckpt_client import CheckpointException, DaemonRequestError
    from ckpt_client.integrations.lightning import CkptdCheckpointIO

    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    io = CkptdCheckpointIO()
    path = os.path.join(daemon.roots[0], "sub", "model.ckpt")
    weights = torch.randn(64, 64)
    io.save_checkpoint({"w": weights, "epoch": 3, "name": "x"}, path)
    expected = weights.clone()
    weights.add_(1.0)  # after save_checkpoint returns, the checkpoint no longer aliases it
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["w"], expected) and loaded["epoch"] == 3
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"w": weights}, path, storage_options={"x": 1})
    io.remove_checkpoint(path)
    assert not os.path.exists(path) and not os.path.exists(path + ".ckptd-sum")
    io.teardown()
    # refused outside the daemon's roots: at the call when staging before returning; at
    # the next wait (the optimizer's update, a load, teardown) for a zero-stall save
    io = CkptdCheckpointIO(zero_stall=False)
    with pytest.raises(DaemonRequestError, match="outside the allowed roots"):
        io.save_checkpoint({"w": weights}, str(tmp_path / "elsewhere" / "m.ckpt"))
    io.teardown()
    io = CkptdCheckpointIO()
    io.save_checkpoint({"w": weights}, str(tmp_path / "elsewhere" / "m.ckpt"))
    for wait in (io.wait_for_staging, io.teardown):  # the failed save is not forgotten
        with pytest.raises(CheckpointException, match="outside the allowed roots"):
            wait()



def test_zero_stall_saves_the_state_of_the_save_call(start_daemon, tmp_path, monkeypatch):
    """Zero-stall saves return before the tensors are staged, and the optimizer steps
    right after each save: every file must still hold, bit for bit, the checkpoint
    Lightning built at the save call. The daemon's pool holds one save and its writers
    are paused, so the second save cannot be staged until the first is written: the next
    update must wait for it (the guard), and batch norm's running statistics, which the
    next forward changes, must have been copied at the call."""
    import copy
    import signal
    import threading

    from faults import writer_pids
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt_client.integrations.lightning import CkptdCheckpointIO

    class Net(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.BatchNorm1d(256),
                                           *[torch.nn.Linear(256, 256) for _ in range(4)])

        def training_step(self, batch, _):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    class AtSaveCall(Callback):
        def __init__(self) -> None:
            self.saved: dict[int, dict] = {}
            self.second_built = threading.Event()

        def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
            self.saved[checkpoint["global_step"]] = {
                k: copy.deepcopy(checkpoint[k]) for k in ("state_dict", "optimizer_states")}
            if len(self.saved) == 2:
                self.second_built.set()

    daemon = start_daemon(pool_size="4M")  # one save is ~3.2 MB (weights and Adam state)
    monkeypatch.setenv("CKPTD_SOCKET", daemon.socket)
    ckpt = os.path.join(daemon.roots[0], "zero-stall")
    at_save = AtSaveCall()
    writers = writer_pids(daemon)
    for pid in writers:
        os.kill(pid, signal.SIGSTOP)

    def resume_writers_once_second_save_waits() -> None:
        try:
            at_save.second_built.wait(120)
            wait_for(lambda: len(in_flight(daemon)) >= 2, 60, "the second save in the daemon")
        finally:
            for pid in writers:
                os.kill(pid, signal.SIGCONT)

    resumer = threading.Thread(target=resume_writers_once_second_save_waits)
    resumer.start()
    try:
        torch.manual_seed(0)
        trainer = Trainer(max_steps=4, accelerator="cpu", logger=False,
                          enable_progress_bar=False, enable_model_summary=False,
                          plugins=[CkptdCheckpointIO()],
                          callbacks=[at_save, ModelCheckpoint(dirpath=ckpt, every_n_train_steps=1,
                                                              save_top_k=-1)])
        trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(64, 256)), batch_size=16))
    finally:
        at_save.second_built.set()
        resumer.join()

    assert sorted(at_save.saved) == [1, 2, 3, 4]
    for step, expected in at_save.saved.items():
        saved = torch.load(os.path.join(ckpt, f"epoch=0-step={step}.ckpt"), weights_only=True)
        assert_same({k: saved[k] for k in expected}, expected, f"step {step}")
