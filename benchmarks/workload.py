"""The state dict the save benchmarks write, and the "training step" run after a save.

The state dict imitates a transformer checkpoint: a few large matrices (embedding,
output projection: 64-256 MiB at 1 GiB total), many medium layer weights (1-16 MiB,
some in bf16/fp16), many small biases and norm weights (KiB), int64 buffers, and a few
plain Python values (step, learning rate, a name, a list). Sizes scale with the
requested total so ``--quick`` runs keep the same shape of mix.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

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


def tensors_of(state: dict) -> list[torch.Tensor]:
    """Every tensor of a state dict built by :func:`build_state_dict`, in order."""
    return [t for group in (state["model"], state["buffers"]) for t in group.values()]


class TrainingStep:
    """A fixed CPU (or GPU) workload standing in for one training step.

    Four 1024x1024 matmuls plus an in-place update of every tensor of the state dict
    (``add_``), so the step touches every page the checkpoint covers: copy-on-write,
    page faults or memory-bandwidth contention from a save in flight show up here.
    """

    def __init__(self, state: dict, device: str = "cpu") -> None:
        gen = torch.Generator().manual_seed(1)
        self.a = torch.randn(1024, 1024, generator=gen).to(device)
        self.b = torch.randn(1024, 1024, generator=gen).to(device)
        self.tensors = tensors_of(state)
        self.device = device

    def run(self) -> float:
        """Run one step; returns its duration in seconds."""
        start = time.perf_counter()
        x = self.a
        for _ in range(4):
            x = torch.tanh(x @ self.b)
        for t in self.tensors:
            t.add_(1 if not t.dtype.is_floating_point else 1e-3)
        if self.device != "cpu":
            torch.cuda.synchronize()
        return time.perf_counter() - start
