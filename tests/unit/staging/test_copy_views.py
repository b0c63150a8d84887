"""The views one part of a CUDA save is copied through (ckptd.staging.copy_views), built
over CPU storages standing in for opened exports: the pool must end up holding each
tensor's values in row-major order, whatever its storage, offset and strides."""

from __future__ import annotations

import pytest
import torch

from ckptd.protocol import layout_extent
from ckptd.staging.copy_views import part_copies


def spec_of(tensor: torch.Tensor, storage_id: int) -> dict:
    """The description a trainer sends for ``tensor`` (as its IPC spec names it)."""
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "size": list(tensor.shape),
            "stride": list(tensor.stride()), "offset": tensor.storage_offset(),
            "storage": storage_id}


def copy_part(tensors: list, base: int = 4096) -> tuple[torch.Tensor, list]:
    storages = {}
    specs = []
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr()
        storages.setdefault(key, tensor.untyped_storage())
        specs.append(spec_of(tensor, key))
    nbytes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = layout_extent(nbytes)
    pool = torch.zeros(base + total, dtype=torch.uint8)
    destinations, sources = part_copies(torch, specs, [base + o for o in offsets], nbytes,
                                        pool, lambda spec: storages[spec["storage"]])
    torch._foreach_copy_(destinations, sources)
    return pool, [base + o for o in offsets]


def test_each_tensor_lands_in_the_pool_in_row_major_order():
    weight = torch.randn(64, 33)
    shared = torch.arange(1000, dtype=torch.int64)
    tensors = [weight, weight.t(), weight[5:9], shared[10:20], shared[500:], shared[:0],
               torch.randn(3, 1, 5)[:, :, 1:4], torch.ones(7, dtype=torch.bfloat16),
               torch.tensor(3.5), torch.randn(2, 3).expand(4, 2, 3)[1]]
    pool, starts = copy_part(tensors)
    for tensor, start in zip(tensors, starts):
        flat = tensor.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(pool[start:start + flat.numel()], flat)


def test_tensors_of_one_storage_share_its_byte_view():
    shared = torch.arange(100, dtype=torch.float32)
    tensors = [shared[:10], shared[10:50], shared[50:]]
    specs = [spec_of(t, 0) for t in tensors]
    pool = torch.zeros(8192, dtype=torch.uint8)
    _, sources = part_copies(torch, specs, [0, 64, 256], [40, 160, 200], pool,
                             lambda _: shared.untyped_storage())
    assert sources[0]._base is not None
    assert sources[0]._base is sources[1]._base is sources[2]._base  # one view of the storage
    assert torch.equal(sources[1].view(torch.float32), shared[10:50])


@pytest.mark.parametrize("change, message", [
    (lambda spec: spec.update(offset=95), "reaches byte 420 of its storage of 400"),
    (lambda spec: spec.update(stride=[1, 10], size=[10, 10], offset=5), "reaches byte 420"),
    (lambda spec: spec.update(offset=-1), "not a tensor's layout"),
    (lambda spec: spec.update(dtype="bytes"), "unsupported dtype"),
    (lambda spec: spec.update(dtype="complex_nonsense"), "unsupported dtype"),
])
def test_a_description_past_its_storage_or_of_no_tensor_dtype_is_refused(change, message):
    # A trainer (or a forged message) must never make the daemon read outside the memory
    # it exported, nor copy a cut-short slice into the pool.
    tensor = torch.arange(100, dtype=torch.float32)
    spec = spec_of(tensor[:10], 0)
    change(spec)
    nbytes = 4 * 10 if spec["dtype"] != "float32" or len(spec["size"]) == 1 else 400
    pool = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match=message):
        part_copies(torch, [spec], [0], [nbytes], pool, lambda _: tensor.untyped_storage())
    assert tensor.untyped_storage().nbytes() == 400  # nothing grew it either


def test_a_size_other_than_the_declared_one_is_refused():
    tensor = torch.arange(10, dtype=torch.float32)
    pool = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not match the 39 bytes"):
        part_copies(torch, [spec_of(tensor, 0)], [0], [39], pool,
                    lambda _: tensor.untyped_storage())
