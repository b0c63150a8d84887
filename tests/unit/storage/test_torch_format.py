"""torch's file format written without torch: stock torch.load and DCP read it, and the bytes
are torch.save's own."""

import dataclasses
import io
import math
import mmap
import os
import pickle
import subprocess
import sys
import zipfile
import zlib
from copy import deepcopy

import pytest
import torch
import torch.distributed.checkpoint as torch_dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.utils.serialization import config as serialization_config

from ckptd import protocol
from ckptd.protocol import TensorRef
from ckptd.storage.jobs import WriteItems
from ckptd.storage.torch_format import (DEFAULT_ALIGNMENT, DTYPES, PAGE_ALIGNMENT,
                                        pickle_skeleton, raw_tensor, write_tensor_file,
                                        write_torch_file)
from ckptd.storage.writer_process import Writer

from pool_fixtures import pool_path, writer  # noqa: F401 (fixtures)

ALL_DTYPES = sorted(DTYPES)
SHAPES = [[], [0], [7], [3, 5], [1, 1, 4], [2, 0, 3], [2, 3, 5, 7], [5, 1]]


def test_every_buffer_dtype_has_a_format():
    assert set(DTYPES) == protocol.BUFFER_DTYPES - {"bytes"}
    for name, layout in DTYPES.items():
        assert torch.empty(0, dtype=getattr(torch, name)).element_size() == layout.itemsize


def random_tensor(dtype: str, shape, seed: int = 0) -> torch.Tensor:
    """Random bytes of every dtype (bool as 0/1: other bytes are not valid bools)."""
    generator = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=generator).bool()
    itemsize = DTYPES[dtype].itemsize
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8,
                        generator=generator)
    return raw.view(torch_dtype).view(shape)


def as_raw(tensor: torch.Tensor):
    """The tensor's own bytes (no copy) as the writer gets them from the pool."""
    flat = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return raw_tensor(memoryview(flat), str(tensor.dtype).removeprefix("torch."),
                      list(tensor.shape))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


class WriteOnly:
    """A stream with nothing but ``write``: proof that nothing is sought or told."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.views = []

    def write(self, data) -> int:
        view = memoryview(data)
        self.views.append((view.obj, view.nbytes))
        self.buffer += view
        return view.nbytes


def write(skeleton, tensors, **options) -> bytes:
    stream = WriteOnly()
    decoded = protocol.unpack_value(protocol.pack_value(skeleton))
    size = write_torch_file(stream, decoded, [as_raw(t) for t in tensors], **options)
    assert size == len(stream.buffer)
    return bytes(stream.buffer)


def torch_save(skeleton, tensors, crc32: bool, alignment: int = DEFAULT_ALIGNMENT) -> bytes:
    """What torch.save writes for the same decoded skeleton (as the old writer called it),
    with torch's serialization config set to ``crc32`` and ``alignment``."""
    decoded = protocol.unpack_value(protocol.pack_value(skeleton))
    before = (serialization_config.save.compute_crc32, serialization_config.save.storage_alignment)
    serialization_config.save.compute_crc32 = crc32
    serialization_config.save.storage_alignment = alignment
    try:
        buffer = io.BytesIO()
        torch.save(protocol.fill_skeleton(decoded, tensors), buffer)
    finally:
        (serialization_config.save.compute_crc32,
         serialization_config.save.storage_alignment) = before
    return buffer.getvalue()


#: (storage alignment, zip CRCs): ckptd's own files, and torch's defaults with CRCs off and on.
FORMATS = [(PAGE_ALIGNMENT, False), (DEFAULT_ALIGNMENT, False), (DEFAULT_ALIGNMENT, True)]
FORMAT_IDS = ["ckptd-4k-no-crc", "torch-64-no-crc", "torch-default"]


# ---------------------------------------------------------------- stock torch.load reads it

@pytest.mark.parametrize("use_mmap", [False, True], ids=["read", "mmap"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_and_shape_loads_with_stock_torch_load(tmp_path, dtype, use_mmap):
    tensors = [random_tensor(dtype, shape, seed) for seed, shape in enumerate(SHAPES)]
    skeleton = {"by_shape": {str(shape): TensorRef(i) for i, shape in enumerate(SHAPES)}}
    path = tmp_path / f"{dtype}.pt"
    path.write_bytes(write(skeleton, tensors))
    loaded = torch.load(path, weights_only=True, mmap=use_mmap)
    for i, shape in enumerate(SHAPES):
        assert same_bytes(loaded["by_shape"][str(shape)], tensors[i]), shape
        assert loaded["by_shape"][str(shape)].is_contiguous()


def test_a_nested_skeleton_comes_back_as_it_went_in(tmp_path):
    tensors = [random_tensor("float32", [4, 4]), random_tensor("bfloat16", [3]),
               random_tensor("int64", []), random_tensor("complex128", [2, 2])]
    skeleton = {
        "model": {"layer.0.weight": TensorRef(0), "layer.0.bias": TensorRef(1)},
        "optimizer": {"state": {0: {"step": TensorRef(2), "exp_avg": TensorRef(3)}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1],
                                        "amsgrad": False, "foreach": None, "name": "décor"}]},
        "rng": b"\x00\x01\xff" * 50, "empty": b"", "nothing": {}, "none_list": [],
        "big": 2**63 - 1, "negative": -(2**40), "tuple": (1, (2, (3, "x")), [4.5]),
        "shared": [TensorRef(0), TensorRef(0)],
    }
    path = tmp_path / "state.pt"
    path.write_bytes(write(skeleton, tensors))
    for use_mmap in (False, True):
        loaded = torch.load(path, weights_only=True, mmap=use_mmap)
        expected = protocol.fill_skeleton(protocol.unpack_value(protocol.pack_value(skeleton)),
                                          tensors)
        assert loaded.keys() == expected.keys()
        assert same_bytes(loaded["model"]["layer.0.weight"], tensors[0])
        assert same_bytes(loaded["optimizer"]["state"][0]["exp_avg"], tensors[3])
        assert loaded["optimizer"]["param_groups"] == expected["optimizer"]["param_groups"]
        assert {k: loaded[k] for k in ("rng", "empty", "nothing", "none_list", "big",
                                       "negative", "tuple")} == \
            {k: expected[k] for k in ("rng", "empty", "nothing", "none_list", "big",
                                      "negative", "tuple")}
        # One tensor referenced twice is one tensor after loading, as with torch.save.
        first, second = loaded["shared"]
        assert first is second and same_bytes(first, tensors[0])
        assert first.untyped_storage().data_ptr() == \
            loaded["model"]["layer.0.weight"].untyped_storage().data_ptr()


def test_the_zip_is_an_ordinary_aligned_archive(tmp_path):
    tensors = [random_tensor("float32", [5, 3]), random_tensor("uint8", [13])]
    data = write({"a": TensorRef(0), "b": TensorRef(1)}, tensors, crc32=True)
    archive = zipfile.ZipFile(io.BytesIO(data))
    assert archive.testzip() is None  # every record's CRC-32 is right
    names = [info.filename for info in archive.infolist()]
    assert names == ["archive/data.pkl", "archive/.format_version", "archive/.storage_alignment",
                     "archive/byteorder", "archive/data/0", "archive/data/1", "archive/version",
                     "archive/.data/serialization_id"]
    for info in archive.infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        name_length, extra_length = int.from_bytes(data[info.header_offset + 26:][:2], "little"), \
            int.from_bytes(data[info.header_offset + 28:][:2], "little")
        assert (info.header_offset + 30 + name_length + extra_length) % 64 == 0
    assert archive.read("archive/data/0") == tensors[0].numpy().tobytes()


# ---------------------------------------------------------------- torch.save's own bytes

SKELETON_OF_EVERYTHING = {
    "ints": [0, 1, 255, 256, 65535, 65536, -1, -129, 2**31 - 1, 2**31, -2**31, -2**31 - 1,
             2**63 - 1, -2**63, 2**64 - 1],
    "floats": [0.0, -0.0, 1e300, float("inf"), float("-inf"), 3.25],
    "strings": ["", "é", "日本語", "a", "storage", "cpu", "0", "latin1", "x" * 300],
    "bytes": [b"a", b"\xff\x00", b"y" * 1000],
    "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((), ((1,),))],
    "batches": {"l999": [None] * 999, "l1000": list(range(1000)), "l1001": [1.0] * 1001,
                "d1000": {i: i for i in range(1000)}, "d1001": {f"k{i}": i for i in range(1001)}},
    "tensors": {"shared": [TensorRef(0), TensorRef(0)], "scalar": TensorRef(1),
                "empty": TensorRef(2), "looks_like_a_descriptor": TensorRef(3),
                "wide": TensorRef(4), "fp8": TensorRef(5), "u64": TensorRef(6)},
    # msgpack interns map keys: this "cpu" is the very object torch's pickle memoizes.
    "cpu": "storage", "storage": {"cpu": 0},
    7: "an int key", None: True, 1.5: False,
}


def tensors_of_everything():
    # torch's writer mistakes any write that starts with PK\x07\x08 for a data descriptor
    # and folds the next 4 bytes into the serialization id: reproduced, so tested.
    descriptor_like = torch.zeros(6, dtype=torch.int32)
    descriptor_like.view(torch.uint8)[:8] = torch.tensor(list(b"PK\x07\x08\x01\x02\x03\x04"),
                                                         dtype=torch.uint8)
    return [random_tensor("float32", [3, 4]), random_tensor("float64", []),
            random_tensor("bfloat16", [3, 0, 2]), descriptor_like,
            random_tensor("complex64", [2, 3, 4, 5]), random_tensor("float8_e5m2", [9]),
            random_tensor("uint64", [2, 2])]


@pytest.mark.parametrize("alignment,crc32", FORMATS, ids=FORMAT_IDS)
def test_bytes_equal_torch_saves_for_every_kind_of_value(alignment, crc32):
    tensors = tensors_of_everything()
    assert write(SKELETON_OF_EVERYTHING, tensors, crc32=crc32, alignment=alignment) == \
        torch_save(SKELETON_OF_EVERYTHING, tensors, crc32, alignment)


@pytest.mark.parametrize("max_write", [None, 50_000], ids=["whole", "slices"])
def test_large_records_written_in_slices_equal_torch_saves(max_write):
    tensors = [random_tensor("float32", [300, 100]), random_tensor("int8", [3]),
               random_tensor("bfloat16", [70_000])]
    skeleton = {"big": TensorRef(0), "small": TensorRef(1), "other": TensorRef(2)}
    for alignment, crc32 in FORMATS:
        assert write(skeleton, tensors, crc32=crc32, max_write=max_write,
                     alignment=alignment) == torch_save(skeleton, tensors, crc32, alignment)


# The serialization id combines the record names in std::unordered_set order, which changes
# each time the set rehashes (at 13, 29, 59, 127 records: a file has storages + 5).
@pytest.mark.parametrize("storages", [0, 1, 8, 9, 24, 25, 54, 55, 122, 123, 300])
def test_bytes_equal_torch_saves_across_storage_counts(storages):
    tensors = [random_tensor("float16", [storages % 7 + 1], seed) for seed in range(storages)]
    skeleton = {f"layers.{i}.weight": TensorRef(i) for i in range(storages)}
    for alignment, crc32 in FORMATS:
        assert write(skeleton, tensors, crc32=crc32, alignment=alignment) == \
            torch_save(skeleton, tensors, crc32, alignment)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_a_tensor_archive_equals_torch_save_of_the_tensor(dtype):
    tensor = random_tensor(dtype, [3, 7])
    for alignment, crc32 in FORMATS:
        stream = WriteOnly()
        write_tensor_file(stream, as_raw(tensor), crc32=crc32, alignment=alignment)
        assert bytes(stream.buffer) == torch_save(TensorRef(0), [tensor], crc32, alignment)


@pytest.mark.parametrize("nbytes", [0, 4, 65535, 65536, 65537, 3 * 4096 + 1])
@pytest.mark.parametrize("starts_like_a_descriptor", [False, True])
def test_a_tensor_item_from_its_template_equals_torch_save(nbytes, starts_like_a_descriptor):
    # Items of ckptd's own files are built from a per-dtype-and-shape template, except a
    # tensor whose bytes start with a zip data descriptor's signature (torch's serialization
    # id then counts them): both must still be torch.save's bytes, in both alignments.
    tensor = random_tensor("uint8", [nbytes], seed=nbytes)
    if starts_like_a_descriptor and nbytes >= 8:
        tensor[:4] = torch.tensor(list(b"PK\x07\x08"), dtype=torch.uint8)
    for alignment in (DEFAULT_ALIGNMENT, PAGE_ALIGNMENT):
        for _ in range(2):  # the second write comes from the cached template
            stream = WriteOnly()
            size = write_tensor_file(stream, as_raw(tensor), alignment=alignment,
                                     max_write=4096)
            assert bytes(stream.buffer) == torch_save(TensorRef(0), [tensor], False, alignment)
            assert size == len(stream.buffer)


def test_the_pickle_is_the_c_picklers():
    shared = "one object, written once"
    values = [
        [shared, shared, (shared,), {"k": shared}],
        {i: [i] * (i % 3) for i in range(2500)},
        [list(range(n)) for n in (0, 1, 2, 999, 1000, 1001, 2000, 2001)],
        [{str(i): i for i in range(n)} for n in (0, 1, 2, 999, 1000, 1001, 2000, 2001)],
        [2**e + d for e in range(0, 70, 7) for d in (-1, 0, 1)] + [-(2**e) for e in range(70)],
        ["s" * n for n in (0, 1, 255, 256, 70000)] + [float(i) / 7 for i in range(300)],
    ]
    for value in values:
        assert pickle_skeleton(value, [])[0] == pickle.dumps(value, protocol=2)


def test_tensors_sharing_one_shape_object_are_pickled_as_torch_pickles_them():
    shape = (2, 3)
    tensors = [random_tensor("float32", shape, seed) for seed in range(2)]
    skeleton = {"a": TensorRef(0), "b": TensorRef(1)}
    stream = WriteOnly()
    write_torch_file(stream, skeleton, [raw_tensor(as_raw(t).data, "float32", shape)
                                        for t in tensors])
    assert bytes(stream.buffer) == torch_save(skeleton, tensors, crc32=False)


def test_more_than_255_memo_entries_use_the_long_opcodes():
    value = [f"s{i}" for i in range(600)]
    assert pickle_skeleton(value, [])[0] == pickle.dumps(value, protocol=2)
    tensors = [random_tensor("int8", [1], seed) for seed in range(60)]
    skeleton = [f"name{i}" for i in range(300)] + [TensorRef(i) for i in range(60)]
    assert write(skeleton, tensors) == torch_save(skeleton, tensors, crc32=False)


class Digest:
    """Keeps the CRC-32 and size of a stream, not its bytes (for archives over 4 GiB)."""

    def __init__(self) -> None:
        self.crc, self.size, self.largest = 0, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        self.largest = max(self.largest, view.nbytes)
        return view.nbytes

    def flush(self) -> None:
        pass


@pytest.mark.slow
def test_records_and_offsets_past_4_gib_are_torch_saves_zip64():
    size = (1 << 32) + 100  # a record >= 4 GiB, then records whose headers lie past 4 GiB
    # Both sides read never-written anonymous memory (the zero page): no 4 GiB resident.
    reference = Digest()
    before = serialization_config.save.compute_crc32
    serialization_config.save.compute_crc32 = False
    try:
        torch.save({"big": torch.empty(size, dtype=torch.uint8),
                    "after": torch.arange(5, dtype=torch.int16)}, reference)
    finally:
        serialization_config.save.compute_crc32 = before
    zeros = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
    try:
        ours = Digest()
        skeleton = {"big": TensorRef(0), "after": TensorRef(1)}
        write_torch_file(ours, skeleton, [raw_tensor(zeros, "uint8", [size]),
                                          as_raw(torch.arange(5, dtype=torch.int16))],
                         max_write=64 << 20)
    finally:
        zeros.close()
    assert (ours.size, ours.crc) == (reference.size, reference.crc)
    assert ours.largest == 64 << 20


# ---------------------------------------------------------------- streaming, no copies

def test_tensor_bytes_are_streamed_from_the_given_buffer_in_bounded_writes():
    pool = mmap.mmap(-1, 1 << 20)
    pool[:] = os.urandom(1 << 20)
    stream = WriteOnly()
    tensor = raw_tensor(memoryview(pool)[4096:4096 + 400_000], "float32", [100_000])
    write_tensor_file(stream, tensor, max_write=65536)
    data_writes = [n for obj, n in stream.views if obj is pool]
    assert sum(data_writes) == 400_000 and max(data_writes) == 65536
    loaded = torch.load(io.BytesIO(bytes(stream.buffer)), weights_only=True)
    assert loaded.numpy().tobytes() == pool[4096:4096 + 400_000]


def test_small_tensors_are_gathered_into_few_writes():
    tensors = [random_tensor("float32", [16], seed) for seed in range(500)]
    skeleton = [TensorRef(i) for i in range(500)]
    stream = WriteOnly()
    write_torch_file(stream, skeleton, [as_raw(t) for t in tensors])
    assert len(stream.views) <= 2  # ~180 KiB of headers and data: gathered, then flushed
    assert bytes(stream.buffer) == torch_save(skeleton, tensors, crc32=False)


@pytest.mark.parametrize(("buffer", "dtype", "shape", "message"), [
    (b"\0" * 12, "float32", [4], "has 16 bytes"),
    (b"\0" * 4, "float33", [1], "cannot be written"),
    (b"", "float32", [-1], "non-negative"),
    (b"", "bytes", [0], "cannot be written"),
])
def test_a_tensor_that_does_not_add_up_is_refused(buffer, dtype, shape, message):
    with pytest.raises(ValueError, match=message):
        raw_tensor(buffer, dtype, shape)


@pytest.mark.parametrize("skeleton", [{"x": TensorRef(3)}, {"x": {1, 2}}, [object()]])
def test_a_bad_skeleton_fails_before_anything_is_written(skeleton):
    stream = WriteOnly()
    with pytest.raises((TypeError, ValueError)):
        write_torch_file(stream, skeleton, [as_raw(torch.zeros(1))])
    assert stream.buffer == b""


def test_empty_bytes_load_with_weights_only_unlike_torch_saves(tmp_path):
    # torch.save pickles b"" as builtins.bytes(), which weights_only refuses; ours loads.
    path = tmp_path / "empty.pt"
    path.write_bytes(write({"blob": b"", "again": b""}, []))
    assert torch.load(path, weights_only=True) == {"blob": b"", "again": b""}


def test_writing_a_file_imports_no_torch(tmp_path):
    script = (
        "import sys\n"
        "from ckptd.protocol import TensorRef\n"
        "from ckptd.storage import torch_format, writer_process\n"
        "raw = torch_format.raw_tensor(bytearray(24), 'float32', [2, 3])\n"
        f"with open({str(tmp_path / 'x.pt')!r}, 'wb') as f:\n"
        "    torch_format.write_torch_file(f, {'x': TensorRef(0)}, [raw], crc32=True)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert torch.equal(torch.load(tmp_path / "x.pt", weights_only=True)["x"], torch.zeros(2, 3))


# ---------------------------------------------------------------- DCP .distcp files

def dcp_state(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.rand(64, 32, generator=generator), "b": torch.rand(32, generator=generator),
            "emb": torch.rand(10, 8, generator=generator).bfloat16(),
            "step": torch.tensor(seed), "counts": torch.arange(12, dtype=torch.int32).view(3, 4),
            "mask": torch.rand(5, generator=generator) > 0.5,
            # large enough for a page of the file: ending exactly on one, and just past one
            "exact": torch.rand(16384, generator=generator),
            "past": torch.rand(1025, 16, generator=generator),
            "extra": {"epoch": seed, "note": "dcp"}}


def items_like_stock(stock_dir, state: dict, writer: Writer) -> tuple[str, list, int]:
    """The items of stock DCP's only .distcp file, staged into the writer's pool in file
    order: tensors as their bytes, byte items (pickled values) as written."""
    reader = FileSystemReader(stock_dir)
    metadata = reader.read_metadata()
    entries = sorted(metadata.storage_data.items(), key=lambda e: e[1].offset)
    assert len({info.relative_path for _, info in entries}) == 1
    file_name = entries[0][1].relative_path
    with open(os.path.join(stock_dir, file_name), "rb") as f:
        stock_bytes = f.read()
    items, cursor = [], 0
    for index, info in entries:
        value = state[index.fqn] if index.fqn in state else None
        if isinstance(value, torch.Tensor):
            payload = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            items.append([cursor, len(payload), str(value.dtype).removeprefix("torch."),
                          list(value.shape)])
        else:
            payload = stock_bytes[info.offset:info.offset + info.length]
            items.append([cursor, len(payload), "bytes", [len(payload)]])
        writer.pool[cursor:cursor + len(payload)] = payload
        cursor += -(-len(payload) // 64) * 64
    return file_name, items, cursor


@pytest.mark.parametrize("stock", [False, True], ids=["ckptd", "stock-files"])
def test_a_distcp_file_from_items_loads_with_stock_dcp(tmp_path, writer, stock):
    state = dcp_state(5)
    stock_dir, our_dir = tmp_path / "stock", tmp_path / "ours"
    torch_dcp.save(state, storage_writer=FileSystemWriter(stock_dir, single_file_per_rank=True,
                                                          thread_count=1))
    file_name, items, nbytes = items_like_stock(stock_dir, state, writer)
    job = WriteItems(str(our_dir / file_name), file_name, items, nbytes, stock=stock)
    result = writer.execute(protocol.decode(protocol.encode(job.message_type, 1,
                                                                 job.to_wire())))
    assert result.ok, result.error
    metadata = FileSystemReader(stock_dir).read_metadata()
    entries = sorted(metadata.storage_data.items(), key=lambda e: e[1].offset)
    if stock:  # the same bytes: stock's metadata describes our file too
        assert [list(p) for p in result.items] == [[i.offset, i.length] for _, i in entries]
    else:  # the placements go into .metadata
        ours = (our_dir / file_name).read_bytes()
        end = 0
        for (index, info), (start, length) in zip(entries, result.items):
            metadata.storage_data[index] = dataclasses.replace(info, offset=start, length=length)
            value = state.get(index.fqn)
            if isinstance(value, torch.Tensor) and value.nbytes >= 65536:
                # a large tensor's archive on a page, its bytes on the next: O_DIRECT from
                # the pool; the archive's other records are not padded to pages
                payload = value.reshape(-1).view(torch.uint8).numpy().tobytes()
                assert start % 4096 == 0, index
                assert ours[start + 4096:start + 4096 + len(payload)] == payload, index
                assert length < 4096 + len(payload) + 4096, index
            else:  # small items back to back, no page of padding each
                assert start == end, index
            end = start + length
    with open(our_dir / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    loaded = {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else deepcopy(v))
              for k, v in dcp_state(0).items()}
    torch_dcp.load(loaded, storage_reader=FileSystemReader(our_dir))
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert same_bytes(loaded[key], value), key
        else:
            assert loaded[key] == value
    ours = (our_dir / file_name).read_bytes()
    if stock:  # FileSystemWriterAsync's promise: torch's own bytes
        assert ours == (stock_dir / file_name).read_bytes()
        assert not os.path.exists(str(our_dir / file_name) + ".ckptd-sum")
