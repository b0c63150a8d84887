"""A writer job started while its trainer still copies: it reads no buffer of the pool
before the daemon says that buffer is staged, and renames nothing before all are.

The writer runs in a thread of this process against a real pool file and a real PAIR
channel; the test plays the daemon. Each test changes a buffer *after* the writer began
waiting for it: a writer that read it early would write the old bytes.
"""

import errno
import os
import threading

import pytest
import torch

from ckptd import protocol
from ckptd.storage.jobs import CancelJob, StagedThrough, StartJob, WriteItems, WriteTorch
from ckptd.storage.torch_format import raw_tensor, write_torch_file
from ckptd.storage.torch_layout import TorchLayout
from ckptd.storage.writer_channel import ProgressReporter

from conftest import wait_for
from pool_fixtures import pool_path, writer  # noqa: F401 (fixtures)
from test_writer_process import ahead, channel, put  # noqa: F401 (fixture)


class Phases(ProgressReporter):
    """Records the phases the job in hand went through (nothing is sent)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[str] = []

    def __call__(self, phase, bytes_done):
        super().__call__(phase, bytes_done)
        if not self.seen or self.seen[-1] != phase:
            self.seen.append(phase)


def start_early(writer, daemon_side, writer_side, job, job_id: int, through: int):
    """Send ``job`` ahead, park it, and start it with only ``[0, through)`` staged, in a
    thread; returns (thread, results list, phases)."""
    daemon_side.send_multipart(protocol.encode(job.message_type, job_id, ahead(job)))
    writer.inbox.sock = writer_side
    writer.parked.park(job_id, writer.prepare(writer.inbox.next(5000), ahead=True))
    writer.progress = phases = Phases()
    start = protocol.decode(protocol.encode(StartJob.message_type, job_id,
                                            StartJob(through=through).to_wire()))
    results: list = []
    thread = threading.Thread(target=lambda: results.append(writer.start(start)), daemon=True)
    thread.start()
    wait_for(lambda: "staging" in phases.seen, timeout=10, what="the writer to wait for the copy")
    return thread, results, phases


def staged(daemon_side, job_id: int, through: int | None) -> None:
    daemon_side.send_multipart(protocol.encode(StagedThrough.message_type, job_id,
                                               StagedThrough(through).to_wire()))


def test_a_torch_file_is_written_with_the_bytes_staged_after_it_began(writer, tmp_path,
                                                                     channel):
    daemon_side, writer_side = channel
    first, second = torch.arange(1024, dtype=torch.float32), torch.zeros(4096, dtype=torch.float32)
    specs = [put(writer, 0, first), put(writer, 65536, second)]
    skeleton = protocol.pack_value({"first": protocol.TensorRef(0), "second": protocol.TensorRef(1)})
    path = tmp_path / "early.pt"
    job = WriteTorch(str(path), skeleton, specs, first.nbytes + second.nbytes)
    thread, results, phases = start_early(writer, daemon_side, writer_side, job, 5, 4096)
    assert not path.exists()
    final = torch.full((4096,), 7.5)
    put(writer, 65536, final)  # the trainer's copy of the second tensor ends only now
    staged(daemon_side, 5, 65536 + final.nbytes)
    # every byte is written and synced, but "all staged" was not said: it waits to rename
    wait_for(lambda: "fsync" in phases.seen and phases.seen[-1] == "staging", timeout=10,
             what="the writer to wait for the end of staging before its rename")
    assert thread.is_alive() and not path.exists()
    staged(daemon_side, 5, None)
    thread.join(10)
    assert results and results[0].ok, results
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["first"], first) and torch.equal(loaded["second"], final)
    # byte for byte the file of the same job written with every byte staged up front
    again = tmp_path / "whole.pt"
    writer.progress = ProgressReporter(None)
    assert writer.execute(protocol.decode(protocol.encode(
        job.message_type, 6, WriteTorch(str(again), skeleton, specs, job.nbytes).to_wire()))).ok
    assert again.read_bytes() == path.read_bytes()


def test_an_items_file_waits_item_by_item_and_for_the_end_of_staging(writer, tmp_path, channel):
    daemon_side, writer_side = channel
    items = [put(writer, 0, torch.ones(100)), put(writer, 4096, torch.ones(3000)),
             put(writer, 65536, torch.ones(10))]
    path = tmp_path / "__0_0.distcp"
    job = WriteItems(str(path), path.name, items, sum(i[1] for i in items))
    thread, results, phases = start_early(writer, daemon_side, writer_side, job, 8, 400)
    put(writer, 4096, torch.full((3000,), 2.0))
    staged(daemon_side, 8, 65536)  # the middle item is in; the last is not
    wait_for(lambda: phases.seen.count("staging") >= 2, timeout=10,
             what="the writer to wait for the last item")
    put(writer, 65536, torch.arange(10, dtype=torch.float32))
    staged(daemon_side, 8, None)
    thread.join(10)
    assert results and results[0].ok, results
    data = path.read_bytes()
    import io
    loaded = [torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
              for start, length in results[0].items]
    assert torch.equal(loaded[0], torch.ones(100))
    assert torch.equal(loaded[1], torch.full((3000,), 2.0))
    assert torch.equal(loaded[2], torch.arange(10, dtype=torch.float32))


def test_a_job_cancelled_while_it_waits_for_the_copy_leaves_the_path_as_it_was(
        writer, tmp_path, channel):
    daemon_side, writer_side = channel
    path = tmp_path / "model.pt"
    path.write_bytes(b"the previous checkpoint")
    specs = [put(writer, 0, torch.ones(10)), put(writer, 65536, torch.ones(2000))]
    job = WriteTorch(str(path), protocol.pack_value([protocol.TensorRef(0), protocol.TensorRef(1)]),
                     specs, 8040)
    thread, results, _ = start_early(writer, daemon_side, writer_side, job, 9, 40)
    daemon_side.send_multipart(protocol.encode(CancelJob.message_type, 9, {}))
    thread.join(10)
    assert results and not results[0].ok and results[0].errno == errno.ECANCELED
    assert "still copying" in results[0].error
    assert path.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["model.pt"]


@pytest.mark.parametrize("sizes,signed_at", [([64, 5000], 0), ([64, 5000], 1),
                                             ([65536, 64, 5000], 1), ([65536, 64, 5000], 2)])
def test_a_tensor_starting_like_a_data_descriptor_gives_torch_files_bytes(tmp_path, sizes,
                                                                        signed_at):
    # The templates do not count such a tensor in the serialization id; found while the
    # file is written, the rest of the file is write_torch_file's, the same bytes as if
    # it had been found before the first write (after a large tensor: from a point of the
    # file past its first bytes).
    tensors = [torch.arange(n, dtype=torch.int32) for n in sizes]
    tensors[signed_at][:2] = torch.tensor([0x08074B50, 123], dtype=torch.int32)  # "PK\7\8"
    buffers = [memoryview(bytearray(t.numpy().tobytes())) for t in tensors]
    specs = [("int32", list(t.shape), t.nbytes) for t in tensors]
    skeleton = protocol.pack_value({f"t{i}": protocol.TensorRef(i) for i in range(len(sizes))})
    layout = TorchLayout(skeleton, specs, buffers)
    waited: list[int] = []
    early = tmp_path / "early.pt"
    with open(early, "wb") as stream:
        layout.write(stream, staged=waited.append)
    expected = tmp_path / "expected.pt"
    with open(expected, "wb") as stream:
        write_torch_file(stream, protocol.unpack_value(skeleton),
                         [raw_tensor(b, *s[:2]) for b, s in zip(buffers, specs)],
                         alignment=4096)
    assert early.read_bytes() == expected.read_bytes()
    assert set(waited) == set(range(len(sizes)))
    loaded = torch.load(early, weights_only=True)
    assert all(torch.equal(loaded[f"t{i}"], t) for i, t in enumerate(tensors))
