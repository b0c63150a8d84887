"""Each framework's own checkpoint saving against the same framework with its ckptd adapter.

Per framework, on one model and its AdamW state, side by side in one run: the trainer's
blocking time per save (from the save call until the training step may change the
state: for the zero-stall forms that includes waiting for staging before
``optimizer.step()``) and the training step that runs while the save is still being
written, against the same step with no save in flight (the step bound, measured in the
same run). Nothing here asserts a time: ratios of medians, with the spread of each side.

- ``torch.distributed.checkpoint``: ``dcp.save`` (synchronous default), stock
  ``async_save`` (thread executor, default stager), stock ``async_save`` with the process
  executor, and ``async_save`` with ckptd's writer and ``Stager`` (blocking and
  zero-stall).
- Lightning: ``TorchCheckpointIO`` (synchronous ``torch.save``, the default),
  ``AsyncCheckpointIO``, ``CkptdCheckpointIO``, on the checkpoint dict Lightning builds.
- torchtitan: its ``CheckpointManager`` (``disabled``, the default, and ``async``)
  against ``CkptdCheckpointManager`` in ``async`` and ``async_with_pinned_mem`` (stock
  torchtitan's pinned-memory mode needs CUDA: measured only where a GPU is present).
- Hugging Face: ``Trainer._save_checkpoint`` (synchronous) against
  ``CkptdTrainer._save_checkpoint``.

Run from the repository root under ``/work/bin/texcl``::

    python benchmarks/bench_frameworks.py --params-m 32 --saves 4 --out benchmarks/RESULTS_FRAMEWORKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_save import Daemon  # noqa: E402

warnings.simplefilter("ignore")


def mlp(params_m: float) -> torch.nn.Module:
    width = 1024
    layers = max(1, round(params_m * 1e6 / (width * width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def train_step(model, optimizer, batch) -> None:
    model(batch).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


class Runner:
    """Times ``saves`` saves of one method: blocking, then the overlapped step."""

    def __init__(self, model, optimizer, saves: int) -> None:
        self.model, self.optimizer, self.saves = model, optimizer, saves
        self.batch = torch.randn(16, 1024)

    def step_bound(self) -> list[float]:
        return [timed(lambda: train_step(self.model, self.optimizer, self.batch))
                for _ in range(self.saves)]

    def run(self, save, before_step=lambda: None, wait=lambda: None,
            before_update=None) -> dict:
        """``before_step`` waits right after the save, ``before_update`` between the
        backward and ``optimizer.step()`` (where a step guard waits): both count as
        blocking, not as step time."""
        blocking, steps = [], []
        for index in range(self.saves):
            start = time.perf_counter()
            save(index)
            before_step()
            blocked = time.perf_counter() - start
            step_start = time.perf_counter()
            self.model(self.batch).square().mean().backward()
            update_wait = timed(before_update) if before_update else 0.0
            self.optimizer.step()
            self.optimizer.zero_grad()
            steps.append(time.perf_counter() - step_start - update_wait)
            blocking.append(blocked + update_wait)
            wait()
        return {"blocking": blocking, "step": steps}


# ---------------------------------------------------------------------- frameworks
def bench_dcp(runner: Runner, root: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import (AsyncCheckpointerType,
                                                               AsyncSaveResponse)
    from ckpt_client.dcp import Stager, StorageWriter

    def state():
        return {"model": runner.model.state_dict(), "optim": runner.optimizer.state_dict()}

    pending = []

    def finish():
        while pending:
            pending.pop().result()

    results = {"dcp.save (sync default)": runner.run(
        lambda i: dcp.save(state(), checkpoint_id=f"{root}/dcp-sync-{i}", no_dist=True))}
    for kind in (AsyncCheckpointerType.THREAD, AsyncCheckpointerType.PROCESS):
        if kind == AsyncCheckpointerType.PROCESS and not torch.distributed.is_initialized():
            continue
        results[f"dcp.async_save stock ({kind.value})"] = runner.run(
            lambda i, kind=kind: pending.append(dcp.async_save(
                state(), checkpoint_id=f"{root}/dcp-{kind.value}-{i}",
                async_checkpointer_type=kind)), wait=finish)
    results["dcp.async_save + ckptd Stager"] = runner.run(
        lambda i: pending.append(dcp.async_save(
            state(), storage_writer=StorageWriter(f"{root}/dcp-ckptd-{i}"),
            async_stager=Stager())), wait=finish)
    responses: list[AsyncSaveResponse] = []
    results["dcp.async_save + ckptd Stager(zero_stall)"] = runner.run(
        lambda i: responses.append(dcp.async_save(
            state(), storage_writer=StorageWriter(f"{root}/dcp-zs-{i}"),
            async_stager=Stager(zero_stall=True))),
        before_step=lambda: responses[-1].staging_completion.result(),
        wait=lambda: responses.pop().upload_completion.result())
    return results


def lightning_checkpoint(runner: Runner, step: int) -> dict:
    return {"epoch": 0, "global_step": step, "pytorch-lightning_version": "2.6.6",
            "state_dict": runner.model.state_dict(),
            "optimizer_states": [runner.optimizer.state_dict()], "lr_schedulers": [],
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}},
            "callbacks": {}}


def bench_lightning(runner: Runner, root: str) -> dict:
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.plugins.io.async_plugin import AsyncCheckpointIO
    from ckpt_client.integrations.lightning import CkptdCheckpointIO

    results = {}
    for name, io in (("TorchCheckpointIO (sync default)", TorchCheckpointIO()),
                     ("AsyncCheckpointIO", AsyncCheckpointIO(TorchCheckpointIO())),
                     ("CkptdCheckpointIO(zero_stall=False)", CkptdCheckpointIO(zero_stall=False)),
                     ("CkptdCheckpointIO", CkptdCheckpointIO())):
        # as in a Trainer, the optimizer steps before the first save: the plugin's guard
        # has seen it, so its tensors are left to the background copy
        train_step(runner.model, runner.optimizer, runner.batch)
        # teardown waits for AsyncCheckpointIO's writes (its executor is made anew on
        # the next save); CkptdCheckpointIO waits until durable
        wait = getattr(io, "wait_until_durable", io.teardown)
        # the zero-stall wait, timed where the plugin's step guard would wait (the
        # guard then finds the save staged)
        before_update = getattr(io, "wait_for_staging", None)
        results[name] = runner.run(
            lambda i, io=io, name=name: io.save_checkpoint(
                lightning_checkpoint(runner, i), f"{root}/lightning-{name.split()[0]}-{i}.ckpt"),
            wait=wait, before_update=before_update)
        io.teardown()
    return results


def bench_torchtitan(runner: Runner, root: str) -> dict:
    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    from ckpt_client.integrations.torchtitan import CkptdCheckpointManager

    optimizers = OptimizersContainer.Config(param_groups=[ParamGroupConfig(
        pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4})]).build(
        model_parts=[runner.model])
    train_step(runner.model, optimizers, runner.batch)
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=1000)
    titan_runner = Runner(runner.model, optimizers, runner.saves)
    results = {}
    cases = [("CheckpointManager disabled (sync default)", CheckpointManager, "disabled"),
             ("CheckpointManager async", CheckpointManager, "async"),
             ("CkptdCheckpointManager async", CkptdCheckpointManager, "async"),
             ("CkptdCheckpointManager async_with_pinned_mem", CkptdCheckpointManager,
              "async_with_pinned_mem")]
    if torch.cuda.is_available():
        cases.insert(2, ("CheckpointManager async_with_pinned_mem", CheckpointManager,
                         "async_with_pinned_mem"))
    for name, cls, mode in cases:
        manager = cls.Config(enable=True, folder=name.replace(" ", "_"), interval=1,
                             keep_latest_k=0, async_mode=mode).build(
            dataloader=None, model_parts=[runner.model], optimizers=optimizers,
            lr_schedulers=schedulers, states={}, sd_adapter=None, base_folder=root)
        results[name] = titan_runner.run(lambda i, m=manager: m.save(i + 1),
                                         before_step=manager.maybe_wait_for_staging,
                                         wait=manager.maybe_wait_for_saving)
        manager.close()
    return results


def bench_hf(runner: Runner, root: str, params_m: float) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from ckpt_client.integrations.hf import CkptdTrainer

    layers = max(1, round(params_m / 7.1))  # a 768-wide GPT-2 block holds ~7.1M parameters
    results = {}
    for name, cls in (("Trainer (sync default)", Trainer), ("CkptdTrainer", CkptdTrainer)):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=768, n_head=12,
                                           vocab_size=1024, n_positions=64))
        args = TrainingArguments(output_dir=f"{root}/hf-{cls.__name__}", report_to=[],
                                 use_cpu=True, save_total_limit=2, disable_tqdm=True)
        trainer = cls(model=model, args=args)
        trainer.create_optimizer_and_scheduler(num_training_steps=100)
        ids = torch.randint(0, 1024, (4, 64))
        hf_runner = Runner(model, trainer.optimizer, runner.saves)

        def step(model=model, optimizer=trainer.optimizer) -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        hf_runner.batch = None
        bound = [timed(step) for _ in range(runner.saves)]

        def save(i, trainer=trainer):
            trainer.state.global_step = i + 1
            trainer._save_checkpoint(model, None)

        blocking, steps = [], []
        for i in range(runner.saves):
            blocking.append(timed(lambda: save(i)))
            steps.append(timed(step))
            if isinstance(trainer, CkptdTrainer):
                trainer.commit_checkpoints(blocking=True)
        results[name] = {"blocking": blocking, "step": steps, "step_bound": bound}
    return results


# ---------------------------------------------------------------------- report
def summary(samples: list[float]) -> str:
    return f"{statistics.median(samples):.3f} s ({min(samples):.3f}–{max(samples):.3f})"


def render(report: dict) -> str:
    lines = ["# Frameworks: blocking per save, framework default vs ckptd adapter", "",
             f"Machine: {report['machine']}. State: {report['state_mb']:.0f} MB of model + "
             f"AdamW state ({report['params_m']}M parameters); {report['saves']} saves per "
             f"method; medians (min–max).", ""]
    for framework, methods in report["frameworks"].items():
        bound = report["step_bound"].get(framework)
        lines += [f"## {framework}", "",
                  "| method | blocking per save | step during the save | step / step bound |",
                  "| --- | --- | --- | --- |"]
        for name, r in methods.items():
            step_bound = r.get("step_bound", bound)
            ratio = statistics.median(r["step"]) / statistics.median(step_bound)
            lines.append(f"| {name} | {summary(r['blocking'])} | {summary(r['step'])} | "
                         f"{ratio:.2f}× |")
        ckptd = [n for n in methods if "ckptd" in n.lower() or "Ckptd" in n]
        default = next(n for n in methods if "default" in n)
        lines.append("")
        for name in ckptd:
            ours = methods[name]["blocking"]
            lines.append(f"- {name} ({summary(ours)}): " + "; ".join(
                f"{statistics.median(methods[o]['blocking']) / statistics.median(ours):.1f}× "
                f"less blocking than {o} (bound {summary(methods[o]['blocking'])})"
                for o in methods if o not in ckptd))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params-m", type=float, default=32.0, help="model size, M params")
    parser.add_argument("--saves", type=int, default=4)
    parser.add_argument("--only", default="dcp,lightning,torchtitan,hf")
    parser.add_argument("--out", default=None)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-fw-", dir=args.workdir)
    root = os.path.join(work, "ckpt")
    os.makedirs(root)
    torch.set_num_threads(2)
    model = mlp(args.params_m)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    runner = Runner(model, optimizer, args.saves)
    train_step(model, optimizer, runner.batch)
    state_mb = 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    daemon = Daemon(root, pool_size=int(state_mb * 1.2e6 * 2) + (256 << 20), writers=2)
    report = {"machine": f"{os.cpu_count()} CPUs", "params_m": args.params_m,
              "state_mb": state_mb, "saves": args.saves, "frameworks": {}, "step_bound": {}}
    try:
        only = args.only.split(",")
        runner.step_bound()  # warm-up: the first steps of a process are slower
        bound = runner.step_bound()
        if "dcp" in only:
            report["frameworks"]["torch.distributed.checkpoint"] = bench_dcp(runner, root)
            report["step_bound"]["torch.distributed.checkpoint"] = bound
        if "lightning" in only:
            report["frameworks"]["Lightning"] = bench_lightning(runner, root)
            report["step_bound"]["Lightning"] = bound
        if "torchtitan" in only:
            report["frameworks"]["torchtitan"] = bench_torchtitan(runner, root)
            report["step_bound"]["torchtitan"] = bound
        if "hf" in only:
            report["frameworks"]["Hugging Face Trainer"] = bench_hf(runner, root, args.params_m)
    finally:
        daemon.stop()
        torch.distributed.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)
    text = render(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
