"""Reading a local part checks it with the algorithm its record names: parts written before
the checksum changed (crc32 records) still load, and a flipped byte never does."""

import json
import zlib

import pytest
import torch

from ckpt_client.local.part_file import read_part
from ckptd import protocol
from ckptd.checksum import ChecksumMismatchError, checksum_bytes


def write_part(path, tensors: dict) -> bytes:
    """A part file as a writer lays it out: header, then each tensor's bytes."""
    names = list(tensors)
    buffers = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size()]
               for t in tensors.values()]
    skeleton = protocol.pack_value({n: protocol.TensorRef(i) for i, n in enumerate(names)})
    data = protocol.encode_part_header(skeleton, buffers, owner=0, iteration=1, session="") + \
        b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                 for t in tensors.values())
    path.write_bytes(data)
    return data


@pytest.mark.parametrize("record", ["crc32-v1", "crc32c"])
def test_a_part_loads_with_its_records_algorithm_and_a_flipped_byte_is_caught(tmp_path, record):
    tensors = {"w": torch.arange(3000, dtype=torch.float32), "b": torch.ones(7, dtype=torch.bfloat16)}
    path = tmp_path / "rank_0.part"
    data = write_part(path, tensors)
    sidecar = tmp_path / "rank_0.part.ckptd-sum"
    if record == "crc32-v1":  # as written before records had a version
        sidecar.write_text(json.dumps({"algorithm": "crc32", "value": f"{zlib.crc32(data):08x}",
                                       "size": len(data)}))
    else:
        sidecar.write_text(checksum_bytes(data, "crc32c").to_json())
    state, _ = read_part(str(path))
    assert all(torch.equal(state[k], v) for k, v in tensors.items())
    flipped = bytearray(data)
    flipped[-100] ^= 0x01
    path.write_bytes(bytes(flipped))
    with pytest.raises(ChecksumMismatchError, match="corrupted"):
        read_part(str(path))
