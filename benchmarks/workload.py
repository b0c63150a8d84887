"""The state dicts the save benchmarks write, and the "training step" run after a save.

Two workloads, sizes scaled to the requested total so ``--quick`` runs keep their shape:

- ``training`` (the default): what a trainer really checkpoints, a model plus its Adam
  state: every parameter with ``exp_avg`` and ``exp_avg_sq`` (fp32) and a CPU ``step``
  tensor, in a nested ``{"model", "optimizer": {"state", "param_groups"}, ...}`` dict with
  a few hundred plain values. At 2 GiB: about 1238 tensors (about 1000 of 4 B–64 KiB, 230
  of 1–8 MiB, 8 of 64–256 MiB), bf16 parameters with fp32 state. Per-tensor and per-leaf
  costs show here;
- ``mix``: the earlier, coarser mix (a few large matrices, layer weights, biases and int64
  buffers; a handful of plain values), kept for comparison with older results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


@dataclass
class Mix:
    """What a built state dict contains (for the report)."""

    total_bytes: int
    tensors: int
    large: int
    medium: int
    small: int
    by_dtype: dict


def _tensor(nbytes: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = max(1, nbytes // itemsize)
    cols = 1024 if numel % 1024 == 0 and numel >= 1024 else 1
    shape = (numel // cols, cols) if cols > 1 else (numel,)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    else:
        t = torch.randint(0, 50_000, shape, generator=gen, dtype=dtype)
    return t.to(device)


def build_state_dict(total_bytes: int, device: str = "cpu", seed: int = 0) -> tuple[dict, Mix]:
    """A nested state dict of about ``total_bytes`` bytes of tensors.

    Returns
    -------
    (state_dict, mix)
    """
    gen = torch.Generator().manual_seed(seed)
    model: dict = {}
    counts = {"large": 0, "medium": 0, "small": 0}
    # Large: 1/4, 1/8, 1/16, 1/16 of the total (256/128/64/64 MiB at 1 GiB).
    large = [("embed.weight", total_bytes // 4, torch.float32),
             ("output.weight", total_bytes // 8, torch.bfloat16),
             ("pos_embed.weight", total_bytes // 16, torch.float32),
             ("lm_head.extra", total_bytes // 16, torch.float32)]
    for name, nbytes, dtype in large:
        model[name] = _tensor(nbytes, dtype, device, gen)
        counts["large"] += 1
    budget = total_bytes - sum(n for _, n, _ in large)
    # Medium: layer weights of 1..16 MiB until ~97% of the rest is used; small ones per layer.
    medium_sizes = [16 * MiB, 4 * MiB, 8 * MiB, 2 * MiB, 1 * MiB, 12 * MiB]
    medium_dtypes = [torch.float32, torch.float32, torch.bfloat16, torch.float16]
    small_sizes = [4 * KiB, 16 * KiB, 8 * KiB, 64 * KiB]
    layer, i = 0, 0
    while True:
        prefix = f"layers.{layer}"
        nbytes = min(medium_sizes[i % len(medium_sizes)], max(budget - total_bytes // 32, 0))
        if nbytes < MiB:
            break
        for j, part in enumerate(("attn.qkv.weight", "attn.proj.weight", "mlp.fc1.weight")):
            size = min(medium_sizes[(i + j) % len(medium_sizes)], budget - total_bytes // 32)
            if size < MiB:
                break
            model[f"{prefix}.{part}"] = _tensor(size, medium_dtypes[(i + j) % 4], device, gen)
            budget -= size
            counts["medium"] += 1
        for j, part in enumerate(("attn.qkv.bias", "attn.proj.bias", "ln1.weight", "ln1.bias",
                                  "ln2.weight", "ln2.bias", "mlp.fc1.bias")):
            size = small_sizes[(i + j) % len(small_sizes)]
            model[f"{prefix}.{part}"] = _tensor(size, torch.float32, device, gen)
            budget -= size
            counts["small"] += 1
        layer += 1
        i += 1
    # Buffers: int64 (token counts, position ids), and the remainder as one fp32 tensor.
    buffers = {"position_ids": _tensor(64 * KiB, torch.int64, device, gen),
               "token_counts": _tensor(max(budget // 2, 8), torch.int64, device, gen)}
    budget -= 64 * KiB + buffers["token_counts"].nbytes
    counts["small"] += 1
    counts["medium"] += 1
    if budget >= 4:
        model["final_norm.weight"] = _tensor(budget, torch.float32, device, gen)
        counts["small" if budget < MiB else "medium"] += 1
    state = {"model": model, "buffers": buffers,
             "meta": {"step": 12000, "lr": 3.0e-4, "run_name": "bench", "epochs_done": [0, 1, 2],
                      "consumed_samples": 7_680_000}}
    tensors = [t for group in (model, buffers) for t in group.values()]
    by_dtype: dict = {}
    for t in tensors:
        key = str(t.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + t.nbytes
    mix = Mix(sum(t.nbytes for t in tensors), len(tensors), counts["large"], counts["medium"],
              counts["small"], by_dtype)
    return state, mix


def build_training_state(total_bytes: int, device: str = "cpu", seed: int = 0) -> tuple[dict, Mix]:
    """A model + Adam state dict of about ``total_bytes`` bytes (the ``training`` workload).

    Returns
    -------
    (state_dict, mix)
    """
    gen = torch.Generator().manual_seed(seed)
    unit = total_bytes / (2 * GiB)  # sizes below are for a 2 GiB state
    params: list = []  # (name, numel, dtype)
    for i in range(2):  # embedding and output projection: 3 large tensors each with Adam
        params.append((f"embed.{i}.weight", int(48 * MiB * unit), torch.bfloat16))
    for i in range(77):  # layer weights: 1-8 MiB each (param and both moments)
        params.append((f"layers.{i // 7}.w{i % 7}", int((1 + i % 8) * MiB * unit / 5.7),
                       torch.bfloat16 if i % 3 else torch.float32))
    for i in range(230):  # biases, norms: 1-64 KiB
        params.append((f"layers.{i // 23}.b{i % 23}", int((1 + (i * 7) % 64) * KiB * unit / 4),
                       torch.float32))
    model, opt_state = {}, {}
    for index, (name, numel, dtype) in enumerate(params):
        numel = max(numel, 1)
        model[name] = _tensor(numel * torch.empty((), dtype=dtype).element_size(), dtype, device, gen)
        shape = model[name].shape
        opt_state[index] = {"step": torch.tensor(float(12000 + index)),
                            "exp_avg": torch.randn(shape, generator=gen).to(device),
                            "exp_avg_sq": torch.rand(shape, generator=gen).to(device)}
    buffers = {f"rope.{i}": _tensor(int(96 * MiB * unit), torch.float32, device, gen)
               for i in range(2)}
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": wd,
               "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None, "initial_lr": 3e-4,
               "params": [i for i in range(len(params)) if (i < 79) == (wd > 0)]}
              for wd in (0.1, 0.0)]
    state = {"model": {**model, **buffers},
             "optimizer": {"state": opt_state, "param_groups": groups},
             "scheduler": {"last_epoch": 11999, "base_lrs": [3e-4, 3e-4], "_step_count": 12000,
                           "warmup_steps": 2000, "decay_style": "cosine"},
             "dataloader": {"epoch": 3, "consumed_samples": 7_680_000, "seed": 1234,
                            "shard_offsets": list(range(64))},
             "meta": {"iteration": 12000, "run_name": "bench", "world_size": 2,
                      "git_sha": "0123abcd", "args": {f"arg{i}": i * 0.5 for i in range(48)}}}
    tensors = tensors_of(state)
    sizes = [t.nbytes for t in tensors]
    by_dtype: dict = {}
    for t in tensors:
        key = str(t.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + t.nbytes
    large_at = 64 * MiB * unit
    mix = Mix(sum(sizes), len(tensors), sum(s >= large_at for s in sizes),
              sum(MiB * unit / 8 <= s < large_at for s in sizes),
              sum(s < MiB * unit / 8 for s in sizes), by_dtype)
    return state, mix


def build(workload: str, total_bytes: int, device: str = "cpu") -> tuple[dict, Mix]:
    """The state dict of ``workload`` (``training`` or ``mix``)."""
    builder = {"training": build_training_state, "mix": build_state_dict}[workload]
    return builder(total_bytes, device=device)


def tensors_of(state) -> list[torch.Tensor]:
    """Every tensor of a (nested) state dict, in order."""
    found: list = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return found


def leaves_of(state) -> int:
    """How many non-tensor values (leaves) a state dict holds."""
    if isinstance(state, dict):
        return sum(leaves_of(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(leaves_of(v) for v in state)
    return 0 if isinstance(state, torch.Tensor) else 1


class TrainingStep:
    """A fixed CPU (or GPU) workload standing in for one training step.

    A "forward/backward" of 1024x1024 matmuls, then an "optimizer step": an in-place
    update of every tensor of the state dict (``add_``), so the step touches every page
    the checkpoint covers (copy-on-write, page faults or memory-bandwidth contention
    from a save in flight show up here). As in real training, the forward/backward
    takes most of the step: the number of matmuls is calibrated once so that it lasts
    ``compute_ratio`` times the update. That is the window a zero-stall save has to
    stage in before the optimizer step must wait.
    """

    def __init__(self, state: dict, device: str = "cpu", compute_ratio: float = 3.0) -> None:
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(1024, 1024, generator=gen).to(device)
        self.b = torch.randn(1024, 1024, generator=gen).to(device)
        self.tensors = tensors_of(state)
        self.device = device
        update = min(self._timed(self._update) for _ in range(3))
        one = min(self._timed(lambda: self._compute(8)) for _ in range(3)) / 8
        self.matmuls = max(4, round(compute_ratio * update / one))

    def _timed(self, work) -> float:
        start = time.perf_counter()
        work()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    def _compute(self, count: int) -> None:
        x = self.a
        for _ in range(count):
            x = torch.tanh(x @ self.b)

    def _update(self) -> None:
        for t in self.tensors:
            t.add_(1 if not t.dtype.is_floating_point else 1e-3)

    def run(self, before_update=None) -> float:
        """Run one step; returns its duration in seconds.

        ``before_update()`` runs between the forward/backward (the matmuls) and the
        optimizer step (the in-place updates): where a guarded optimizer waits for a
        zero-stall save's staging. Its time is part of the step.
        """
        start = time.perf_counter()
        self._compute(self.matmuls)
        if before_update is not None:
            before_update()
        self._update()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start
