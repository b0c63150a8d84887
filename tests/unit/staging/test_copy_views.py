"""The views one part of a CUDA save is copied through (ckptd.staging.copy_views), built
over CPU storages standing in for opened exports: the pool must end up holding each
tensor's values in row-major order, whatever its storage, offset and strides."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from ckptd.protocol import layout_extent
from ckptd.staging.copy_views import ReusedViews
from ckptd.staging.exports import OpenExports, SaveMappings


def spec_of(tensor: torch.Tensor, storage_id: int) -> dict:
    """The description a trainer sends for ``tensor`` (as its IPC spec names it): one
    export per storage."""
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "size": list(tensor.shape),
            "stride": list(tensor.stride()), "offset": tensor.storage_offset(),
            "storage": storage_id, "handle": str(storage_id).encode(), "storage_offset": 0,
            "ref_counter_handle": b"counters", "ref_counter_offset": storage_id}


def part_copies(torch, specs, starts, expected, pool, storage_of):
    """A first save's views (nothing kept yet), each export opened by ``storage_of``."""
    return ReusedViews().copies(torch, specs, starts, expected, pool,
                                SaveMappings(OpenExports(), storage_of))


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


# ------------------------------------------------------------ views kept from save to save

class Trainer:
    """Storages standing in for one trainer's exports: each export is opened (counted) at
    most once while held, as a device worker opens them through SaveMappings."""

    def __init__(self, tensors: dict) -> None:
        self.tensors = dict(tensors)
        self.counter = 0
        self.exports: dict[str, int] = {}  # name -> its current export's counter slot
        self.opened: list[int] = []
        self.by_handle: dict[bytes, torch.Tensor] = {}
        self.mapped: dict[int, weakref.ref] = {}  # counter slot -> what open_export gave
        self.held = OpenExports()
        self.views = ReusedViews()

    def held_ids(self) -> set:
        return {e for e in {(b"counters", n) for n in range(1, self.counter + 1)}
                if self.held.holds(e)}

    def spec(self, name: str, fresh: bool = False) -> dict:
        tensor = self.tensors[name]
        if fresh or name not in self.exports:
            self.counter += 1
            self.exports[name] = self.counter
        self.by_handle[f"{name}:{id(tensor)}".encode()] = tensor  # a new tensor: new storage
        return {**spec_of(tensor, 0), "handle": f"{name}:{id(tensor)}".encode(),
                "storage_offset": 0,
                "ref_counter_handle": b"counters", "ref_counter_offset": self.exports[name]}

    def save(self, names: list, pool: torch.Tensor, base: int = 0, fresh: tuple = (),
             fail_after_copies: bool = False) -> list:
        specs = [self.spec(name, name in fresh) for name in names]
        nbytes = [self.tensors[n].numel() * self.tensors[n].element_size() for n in names]
        offsets, _ = layout_extent(nbytes)
        starts = [base + o for o in offsets]

        def open_export(spec):
            self.opened.append(spec["ref_counter_offset"])
            # A storage of its own over the trainer's memory, as an IPC mapping is: it
            # dies (its weak reference too) once no view and nothing else refers to it.
            whole = torch.empty(0, dtype=torch.uint8).set_(
                self.by_handle[spec["handle"]].untyped_storage())
            storage = torch.from_numpy(whole.numpy()).untyped_storage()
            self.mapped[spec["ref_counter_offset"]] = weakref.ref(storage)
            return storage

        def copy(mappings):
            destinations, sources = self.views.copies(torch, specs, starts, nbytes, pool,
                                                      mappings)
            if fail_after_copies:  # as a failing device copy or synchronize would
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            torch._foreach_copy_(destinations, sources)
            copy.pairs = list(zip(destinations, sources))

        self.views.stage(self.held, specs, open_export, copy, release=lambda _: None)
        for name, start, n in zip(names, starts, nbytes):
            flat = self.tensors[name].contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(pool[start:start + n], flat), name
        return copy.pairs


def test_a_repeated_save_reuses_its_views_and_copies_the_new_values():
    trainer = Trainer({"w": torch.randn(64, 33), "wt": torch.randn(33, 64).t(),
                       "b": torch.ones(7, dtype=torch.bfloat16)})
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    names = ["w", "wt", "b"]
    trainer.save(names, pool)
    second = trainer.save(names, pool)  # the second save of a storage keeps it open
    assert trainer.held.holds((b"counters", 1))
    opened = len(trainer.opened)
    for tensor in trainer.tensors.values():
        tensor.add_(1)  # the optimizer step
    third = trainer.save(names, pool)  # checks the new values landed
    assert len(trainer.opened) == opened  # nothing opened again
    assert all(a[0] is b[0] and a[1] is b[1] for a, b in zip(second, third))


def test_only_changed_entries_are_rebuilt_and_each_still_lands_right():
    trainer = Trainer({"w": torch.randn(16, 16), "tmp": torch.randn(8), "b": torch.randn(5)})
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    trainer.save(["w", "tmp", "b"], pool)
    before = trainer.save(["w", "tmp", "b"], pool)
    trainer.tensors["tmp"] = torch.randn(8)  # a new temporary: a fresh export
    after = trainer.save(["w", "tmp", "b"], pool, fresh=("tmp",))
    assert after[0][1] is before[0][1] and after[2][1] is before[2][1]
    assert after[1][1] is not before[1][1]
    moved = trainer.save(["w", "tmp", "b"], pool, base=4096)  # another extent
    assert all(a[0] is not b[0] for a, b in zip(moved, after))


def test_views_over_exports_no_longer_held_are_forgotten():
    # A view keeps its storage mapped, and a mapped export's release unpaid: the cache
    # must not outlive the export bookkeeping's decision to drop a storage.
    trainer = Trainer({"w": torch.randn(32), "tmp": torch.randn(8)})
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    trainer.save(["w", "tmp"], pool)
    trainer.save(["w", "tmp"], pool)
    assert trainer.views.exports == {(b"counters", 1), (b"counters", 2)}
    trainer.tensors["tmp"] = torch.randn(8)  # a new temporary, saved once: not held
    trainer.save(["w", "tmp"], pool, fresh=("tmp",))
    assert trainer.views.exports == {(b"counters", 1)} == trainer.held_ids()


def test_a_copy_failing_after_its_views_were_built_leaves_nothing_mapped():
    # The views of a failed part were built (the new export opened) before the copy
    # failed: none may outlive the part, or the trainer's block stays pinned.
    trainer = Trainer({"w": torch.randn(32), "new": torch.randn(8)})
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    trainer.save(["w"], pool)
    trainer.save(["w"], pool)
    with pytest.raises(RuntimeError, match="illegal memory access") as failure:
        trainer.save(["w", "new"], pool, fail_after_copies=True)
    del failure  # its traceback's frames hold the part's locals (the worker drops them)
    gc.collect()
    assert trainer.views.exports == {(b"counters", 1)}
    assert trainer.mapped[2]() is None, "the failed part's opened storage is still referenced"
    assert trainer.held.holds((b"counters", 1))
    trainer.save(["w"], pool)  # and the held view still serves


def test_an_equal_description_declaring_fewer_bytes_is_checked_again():
    # A reused view copies the bytes it was built for: a request that now declares fewer
    # at the same place must be refused, not written past its extent.
    trainer = Trainer({"w": torch.randn(32), "b": torch.randn(8)})
    pool = torch.zeros(1 << 16, dtype=torch.uint8)
    trainer.save(["w", "b"], pool)
    trainer.save(["w", "b"], pool)
    specs = [trainer.spec("w"), trainer.spec("b")]
    mappings = SaveMappings(trainer.held, lambda spec: pytest.fail("held: nothing to open"))
    with pytest.raises(ValueError, match="does not match the 28 bytes"):
        trainer.views.copies(torch, specs, [0, 128], [128, 28], pool, mappings)


@pytest.mark.parametrize("change, declared, message", [
    (lambda spec: spec.update(dtype="evil"), 40, "unsupported dtype"),
    (lambda spec: None, 39, "does not match the 39 bytes"),
    (lambda spec: spec.update(stride=[-1]), 40, "not a tensor's layout"),
])
def test_a_bad_description_is_refused_before_its_export_is_opened(change, declared, message):
    # Opening maps the trainer's memory (and may fail as a denial, which would send the
    # trainer to shared memory): a description that is wrong in itself never gets there.
    tensor = torch.arange(10, dtype=torch.float32)
    spec = {**spec_of(tensor, 0), "handle": b"h", "storage_offset": 0,
            "ref_counter_handle": b"c", "ref_counter_offset": 1}
    change(spec)
    pool = torch.zeros(8192, dtype=torch.uint8)

    def never(_):
        pytest.fail("the export was opened before its description was checked")
    with pytest.raises(ValueError, match=message):
        part_copies(torch, [spec], [0], [declared], pool, never)
