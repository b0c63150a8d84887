"""Bad use of every framework adapter gets a clear error, adapter by adapter.

Three mistakes, each tried on Lightning's ``CkptdCheckpointIO``, torchtitan's
``CkptdCheckpointManager``, Transformers' ``CkptdTrainer`` and Accelerate's
``save_state``:

- a checkpoint path outside the daemon's ``--root`` directories: the daemon refuses and
  the error names the path and the allowed roots;
- no daemon running (and no auto-start): the error names the socket and what to run;
- a framework version outside the supported range: importing (or, for Accelerate,
  calling) the adapter refuses, naming the installed version, the range and the extra
  that installs a tested one. The older release is a real distribution record
  (``*.dist-info``) placed first on the path of a fresh interpreter, the way a stale
  install shadows a newer one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ckpt_client import DaemonRequestError

def lightning_save(path: str, socket: str | None) -> None:
    pytest.importorskip("lightning", reason="the [lightning] extra is not installed")
    from ckpt_client.integrations.lightning import CkptdCheckpointIO

    io = CkptdCheckpointIO(socket=socket)
    io.save_checkpoint({"w": torch.ones(4)}, os.path.join(path, "m.ckpt"))
    io.teardown()


def torchtitan_save(path: str, socket: str | None, mode: str = "disabled") -> None:
    pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")
    from ckpt_client.integrations.torchtitan import CkptdCheckpointManager

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Optimizers:  # the container interface torchtitan's manager saves
        def state_dict(self):
            return optimizer.state_dict()

        def load_state_dict(self, state):
            optimizer.load_state_dict(state)

    manager = CkptdCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, async_mode=mode, socket=socket).build(
        dataloader=None, model_parts=[model], optimizers=Optimizers(), lr_schedulers=None,
        states={}, sd_adapter=None, base_folder=path)
    try:
        manager.save(curr_step=1)
        manager.maybe_wait_for_saving()
    finally:
        manager.close()


def transformers_save(path: str, socket: str | None) -> None:
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    from ckpt_client.integrations.hf import CkptdTrainer
    from hf_run import Tokens

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128,
                                       n_positions=16))
    args = TrainingArguments(output_dir=path, max_steps=1, save_steps=1, report_to=[],
                             per_device_train_batch_size=2, use_cpu=True, disable_tqdm=True)
    CkptdTrainer(model=model, args=args, train_dataset=Tokens(), ckptd_socket=socket).train()


def accelerate_save(path: str, socket: str | None) -> None:
    pytest.importorskip("accelerate", reason="the [hf] extra is not installed")
    pytest.importorskip("transformers", reason="the [hf] extra is not installed")
    from accelerate import Accelerator
    from ckpt_client.integrations.hf import save_state, wait_until_durable

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(4, 4))
    save_state(accelerator, path, socket=socket)
    wait_until_durable(accelerator, socket=socket)


ADAPTERS = {"lightning": lightning_save, "torchtitan": torchtitan_save,
            "transformers": transformers_save, "accelerate": accelerate_save}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_path_outside_the_daemons_roots_is_refused_naming_it(adapter, shared_daemon, tmp_path):
    outside = str(tmp_path / "not-a-root")
    with pytest.raises(BaseException) as caught:  # torch's CheckpointException included
        ADAPTERS[adapter](outside, shared_daemon.socket)
    text = str(caught.value)
    assert "outside the allowed roots" in text and "not-a-root" in text, text
    if isinstance(caught.value, DaemonRequestError):
        assert shared_daemon.roots[0] in text, text


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_no_daemon_running_names_the_socket_and_the_fix(adapter, tmp_path, monkeypatch):
    socket = str(tmp_path / "nobody" / "ckptd.sock")
    monkeypatch.setenv("CKPTD_AUTO_START", "0")
    with pytest.raises(BaseException) as caught:
        ADAPTERS[adapter](str(tmp_path / "ckpt"), socket)
    text = str(caught.value)
    assert socket in text and "ckptd serve" in text, text


def test_torchtitan_async_modes_without_a_daemon_name_the_socket(tmp_path, monkeypatch):
    """The async modes (they need a process group) fail as clearly."""
    pytest.importorskip("torchtitan", reason="the [torchtitan] extra is not installed")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg-store", rank=0,
                            world_size=1)
    try:
        _torchtitan_async_without_a_daemon(tmp_path, monkeypatch)
    finally:
        dist.destroy_process_group()


def _torchtitan_async_without_a_daemon(tmp_path, monkeypatch) -> None:
    socket = str(tmp_path / "nobody" / "ckptd.sock")
    monkeypatch.setenv("CKPTD_AUTO_START", "0")
    for mode in ("async", "async_with_pinned_mem"):
        with pytest.raises(BaseException) as caught:
            torchtitan_save(str(tmp_path / mode), socket, mode)
        assert socket in str(caught.value), (mode, str(caught.value))


# distribution, the adapter's import (and call), an older release, the extra named
CASES = [
    ("lightning", "import ckpt_client.integrations.lightning", "2.5.0", "lightning"),
    ("torchtitan", "import ckpt_client.integrations.torchtitan", "0.2.2", "torchtitan"),
    ("transformers", "import ckpt_client.integrations.hf", "4.57.0", "hf"),
    ("accelerate", "import ckpt_client.integrations.hf as hf; hf.save_state(None, 'x')",
     "1.9.0", "hf"),
]

PROBE = textwrap.dedent("""
    import json, os, sys
    from ckpt_client.integrations import UnsupportedFrameworkError
    out = {}
    for name, code, directory in json.loads(sys.argv[1]):
        sys.path.insert(0, directory)
        try:
            exec(code)
            out[name] = None
        except UnsupportedFrameworkError as exc:
            out[name] = str(exc)
        finally:
            sys.path.remove(directory)
    print(json.dumps(out))
""")


def test_a_framework_version_outside_the_range_is_refused_with_the_fix(tmp_path):
    for distribution, _, _, _ in CASES:
        pytest.importorskip(distribution, reason=f"{distribution} is not installed")
    probes = []
    for distribution, code, old, _ in CASES:
        record = tmp_path / distribution / f"{distribution}-{old}.dist-info"
        record.mkdir(parents=True)
        (record / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {old}\n")
        probes.append((distribution, code, str(tmp_path / distribution)))
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(probes)], check=True,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CKPTD_AUTO_START": "0"})
    messages = json.loads(done.stdout.strip().splitlines()[-1])
    from ckpt_client.integrations.versions import SUPPORTED

    for distribution, _, old, extra in CASES:
        text = messages[distribution]
        assert text is not None, f"{distribution} {old} was accepted"
        low, high = SUPPORTED[distribution]
        assert f"{distribution} {old}" in text and f">={low},<{high}" in text, text
        assert f"pip install 'ckptd[{extra}]'" in text, text
