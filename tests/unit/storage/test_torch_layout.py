"""ckptd's torch files from a per-layout template: torch.save's bytes, whatever was cached."""

import io
import mmap
import os

import pytest
import torch

from ckptd import protocol
from ckptd.protocol import TensorRef
from ckptd.storage.torch_format import PAGE_ALIGNMENT
from ckptd.storage.torch_layout import torch_layout_size, write_torch_layout

from test_torch_format import (SKELETON_OF_EVERYTHING, WriteOnly, random_tensor, same_bytes,
                               tensors_of_everything, torch_save)


def layout_write(skeleton, tensors, max_write=None) -> tuple[bytes, WriteOnly]:
    """What the writer process writes for ``skeleton`` (packed as the daemon sends it)."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    buffers = [memoryview(bytearray(b)) for b in flat]
    specs = [(str(t.dtype).removeprefix("torch."), list(t.shape), len(b))
             for t, b in zip(tensors, flat)]
    stream = WriteOnly()
    # known before the write (the writer allocates the file with it), from the templates
    # the write then uses: made here on a new layout, reused on a known one
    predicted = torch_layout_size(protocol.pack_value(skeleton), specs, buffers, PAGE_ALIGNMENT)
    size = write_torch_layout(stream, protocol.pack_value(skeleton), specs, buffers,
                              max_write=max_write, alignment=PAGE_ALIGNMENT)
    assert predicted == size == len(stream.buffer)
    return bytes(stream.buffer), stream


def model(step: int, count: int = 40) -> tuple[dict, list]:
    """A state dict of small and large tensors (some shared) and a changing step."""
    tensors = [random_tensor("float32" if i % 3 else "bfloat16",
                             [(i % 5 + 1) * (40_000 if i % 7 == 0 else 16)], seed=i)
               for i in range(count)]
    skeleton = {"model": {f"w{i}": TensorRef(i) for i in range(count)},
                "tied": TensorRef(0), "iteration": step, "args": {"lr": 3e-4}}
    return skeleton, tensors


def test_repeated_saves_from_the_cache_equal_torch_saves():
    skeleton, tensors = model(step=1)
    expected = torch_save(skeleton, tensors, crc32=False, alignment=PAGE_ALIGNMENT)
    for _ in range(3):  # built, then twice from the templates
        assert layout_write(skeleton, tensors)[0] == expected


@pytest.mark.parametrize("step", [2, 10 ** 15, "x" * 9000], ids=["same-page", "longer", "pages"])
def test_a_changed_skeleton_value_with_the_same_layout_equals_torch_save(step):
    # the skeleton's pickle changes; the rest is reused when its start stays on its page
    before, tensors = model(step=1)
    layout_write(before, tensors)
    after, _ = model(step=step)
    assert layout_write(after, tensors)[0] == \
        torch_save(after, tensors, crc32=False, alignment=PAGE_ALIGNMENT)


def test_every_kind_of_value_and_a_descriptor_like_tensor_equal_torch_save():
    # one tensor starts like a zip data descriptor: torch counts it, so no template
    tensors = tensors_of_everything()
    for _ in range(2):
        assert layout_write(SKELETON_OF_EVERYTHING, tensors)[0] == \
            torch_save(SKELETON_OF_EVERYTHING, tensors, crc32=False, alignment=PAGE_ALIGNMENT)


@pytest.mark.parametrize("nbytes", [0, 4096, 65535, 65536, 65536 + 4096, 65536 + 4097])
def test_tensors_ending_on_and_past_a_page_equal_torch_save(nbytes):
    tensors = [random_tensor("uint8", [nbytes], seed=1), random_tensor("int16", [3], seed=2),
               random_tensor("uint8", [nbytes], seed=3)]
    skeleton = [TensorRef(0), TensorRef(1), TensorRef(2)]
    for _ in range(2):
        data, stream = layout_write(skeleton, tensors, max_write=16384)
        assert data == torch_save(skeleton, tensors, crc32=False, alignment=PAGE_ALIGNMENT)


def test_large_tensors_go_from_their_buffer_in_bounded_writes_and_load_with_mmap(tmp_path):
    pool = mmap.mmap(-1, 1 << 20)
    pool[:] = os.urandom(1 << 20)
    buffers = [memoryview(pool)[4096:4096 + 400_000], memoryview(pool)[500_000:500_016]]
    specs = [("float32", [100_000], 400_000), ("float32", [4], 16)]
    skeleton = protocol.pack_value({"big": TensorRef(0), "small": TensorRef(1)})
    for _ in range(2):
        stream = WriteOnly()
        write_torch_layout(stream, skeleton, specs, buffers, max_write=65536)
        data_writes = [n for obj, n in stream.views if obj is pool]
        assert sum(data_writes) == 400_000 and max(data_writes) == 65536
        path = tmp_path / "big.pt"
        path.write_bytes(stream.buffer)
        loaded = torch.load(path, weights_only=True, mmap=True)
        assert loaded["big"].numpy().tobytes() == pool[4096:4096 + 400_000]
        assert loaded["small"].numpy().tobytes() == pool[500_000:500_016]


def test_a_size_that_does_not_add_up_is_refused_before_anything_is_written():
    stream = WriteOnly()
    with pytest.raises(ValueError, match="has 16 bytes"):
        write_torch_layout(stream, protocol.pack_value([TensorRef(0)]),
                           [("float32", [4], 12)], [memoryview(bytearray(12))])
    assert not stream.buffer


def test_loads_as_the_state_it_was():
    skeleton, tensors = model(step=7)
    data, _ = layout_write(skeleton, tensors)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert loaded["iteration"] == 7 and loaded["tied"] is loaded["model"]["w0"]
    for i, tensor in enumerate(tensors):
        assert same_bytes(loaded["model"][f"w{i}"], tensor)
