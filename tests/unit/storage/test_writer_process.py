"""A writer's jobs, run in this process against a real pool file: files torch and DCP read."""

import errno
import io
import os

import pytest
import torch

from ckptd import protocol
from ckptd.storage.jobs import CancelJob, StartJob, WriteItems, WriteTorch
from ckptd.storage.layout import file_size
from ckptd.storage.writer_process import ProgressReporter, Writer

from pool_fixtures import pool_path, writer  # noqa: F401 (fixtures)


def put(writer: Writer, offset: int, tensor: torch.Tensor) -> list:
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:  # an empty tensor has no bytes to put
        return [offset, 0, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
    view = torch.frombuffer(writer.pool, dtype=torch.uint8, count=nbytes, offset=offset)
    view.copy_(tensor.view(-1).view(torch.uint8))
    return [offset, nbytes, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]


def run(writer: Writer, body) -> object:
    message = protocol.decode(protocol.encode(body.message_type, 1, body.to_wire()))
    return writer.execute(message)


def test_a_torch_job_writes_a_file_torch_load_reads(writer, tmp_path):
    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.ones(4, dtype=torch.bfloat16)
    specs = [put(writer, 0, a), put(writer, 4096, b)]
    skeleton = protocol.pack_value({"a": protocol.TensorRef(0), "nested": [protocol.TensorRef(1), 7]})
    path = str(tmp_path / "m.pt")
    result = run(writer, WriteTorch(path, skeleton, specs, 32))
    assert result.ok and result.size == os.path.getsize(path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["nested"][0], b)
    assert loaded["nested"][1] == 7


def test_an_items_job_records_where_each_item_landed(writer, tmp_path):
    raw = put(writer, 0, torch.arange(16, dtype=torch.uint8))
    raw[2], raw[3] = "bytes", [16]
    path = str(tmp_path / "x.distcp")
    result = run(writer, WriteItems(path, "x.distcp", [raw, put(writer, 4096, torch.zeros(3))], 28))
    assert result.ok and len(result.items) == 2
    start, length = result.items[0]
    assert open(path, "rb").read()[start:start + length] == bytes(range(16))


@pytest.mark.parametrize("shapes", [[[16]], [[3], [1024], [1025, 3]], [[0], [7, 9], [5000]],
                                    [[5], [16384], [7], [1025, 16], [3]]])
def test_an_items_file_is_as_large_as_its_size_allocated_up_front(writer, tmp_path, shapes):
    # A DCP file's space is allocated from the layout's rule before the first write: the
    # rule must give the size the writer then writes, byte items and tensors alike.
    specs, offset = [], 0
    for index, shape in enumerate(shapes):
        spec = put(writer, offset, torch.full(shape, float(index)))
        if index == 0:
            spec[2], spec[3] = "bytes", [spec[1]]
        specs.append(spec)
        offset += -(-max(spec[1], 1) // 4096) * 4096
    path = str(tmp_path / "x.distcp")
    result = run(writer, WriteItems(path, "x.distcp", specs, 100))
    assert result.ok
    assert file_size([[d, s, n] for _, n, d, s in specs]) == result.size == \
        os.path.getsize(path)


def test_an_os_error_comes_back_with_its_errno_and_path(writer, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    spec = put(writer, 0, torch.zeros(2))
    result = run(writer, WriteItems(str(blocker / "step" / "f"), "f", [spec], 8))
    assert not result.ok and result.errno == 20 and str(blocker) in result.path
    assert "ENOTDIR" in result.error


def test_a_malformed_job_is_a_failed_result_not_a_dead_writer(writer):
    message = protocol.decode(protocol.encode(WriteItems.message_type, 3, {"path": "/x"}))
    result = writer.execute(message)
    assert not result.ok and "needs 'name'" in result.error


def test_a_message_that_is_no_job_is_a_failed_result(writer):
    message = protocol.decode(protocol.encode("write_everything", 4, {"path": "/x"}))
    result = writer.execute(message)
    assert not result.ok and "'write_everything' is not a writer job" in result.error
    assert result.path == "/x"


def test_hostile_bytes_on_the_writer_channel_are_answered_not_fatal(writer, tmp_path):
    import threading

    import msgpack
    import zmq

    context = zmq.Context()
    daemon_side, writer_side = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    daemon_side.bind("inproc://writer-channel")
    writer_side.connect("inproc://writer-channel")
    thread = threading.Thread(target=writer.run, args=(writer_side,), daemon=True)
    thread.start()
    try:
        assert daemon_side.poll(5000) and protocol.decode(daemon_side.recv_multipart()).type \
            == "writer_ready"
        bomb = msgpack.packb([])
        for _ in range(1000):
            bomb = msgpack.packb(msgpack.ExtType(2, bomb))
        for frames in ([bomb], [b"\x91" * 100_000 + b"\x90"], [b"\xc1"]):
            daemon_side.send_multipart(frames)
            assert daemon_side.poll(5000), "the writer stopped answering"
            reply = protocol.decode(daemon_side.recv_multipart())
            assert reply.body["ok"] is False and "undecodable" in reply.body["error"]
        job = WriteItems(str(tmp_path / "after.distcp"), "after.distcp",
                         [put(writer, 0, torch.ones(2))], 8)
        daemon_side.send_multipart(protocol.encode(job.message_type, 5, job.to_wire()))
        assert daemon_side.poll(5000) and protocol.decode(daemon_side.recv_multipart()).body["ok"]
        daemon_side.send_multipart(protocol.encode("stop", 0))
        thread.join(10)
        assert not thread.is_alive()
    finally:
        daemon_side.close(linger=0)
        writer_side.close(linger=0)
        context.term()


def torch_mapped(pid: int) -> list[str]:
    """Files of torch's package mapped into process ``pid`` (its extension, libtorch)."""
    package = os.path.dirname(torch.__file__)
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-1] for line in f if package in line})


def test_a_writer_process_writes_torch_and_dcp_files_without_importing_torch(
        tmp_path, pool_path, writer):
    import subprocess
    import sys

    import zmq

    assert torch_mapped(os.getpid()), "the probe must see torch where it is imported"
    a, b = torch.randn(3, 4), torch.arange(5, dtype=torch.int64)
    specs = [put(writer, 0, a), put(writer, 4096, b)]  # into the pool the process maps
    context = zmq.Context()
    daemon_side = context.socket(zmq.PAIR)
    port = daemon_side.bind_to_random_port("tcp://127.0.0.1")
    process = subprocess.Popen(
        [sys.executable, "-m", "ckptd.storage.writer_process", "--endpoint",
         f"tcp://127.0.0.1:{port}", "--parent-pid", str(os.getpid()), "--pool", pool_path,
         "--pool-size", str(len(writer.pool))])
    try:
        assert daemon_side.poll(60_000), "the writer never said it was ready"
        assert protocol.decode(daemon_side.recv_multipart()).type == "writer_ready"
        skeleton = protocol.pack_value({"a": protocol.TensorRef(0), "b": [protocol.TensorRef(1)]})
        jobs = [WriteTorch(str(tmp_path / "m.pt"), skeleton, specs, 100),
                WriteItems(str(tmp_path / "x.distcp"), "x.distcp", specs, 100),
                WriteItems(str(tmp_path / "s.distcp"), "s.distcp", specs, 100, stock=True)]
        results, phases = [], []
        for number, job in enumerate(jobs):
            daemon_side.send_multipart(protocol.encode(job.message_type, number, job.to_wire()))
            while True:  # progress reports, then the result
                assert daemon_side.poll(60_000), f"no result for {job.message_type}"
                message = protocol.decode(daemon_side.recv_multipart())
                assert message.id == number
                if message.type != "progress":
                    break
                phases.append((number, message.body["phase"]))
            results.append(message.body)
        assert all(r["ok"] for r in results), results
        for number in range(len(jobs)):  # every phase reported, in order
            seen = [phase for n, phase in phases if n == number]
            assert [p for i, p in enumerate(seen) if p not in seen[:i]] == \
                ["create", "write", "fsync", "commit"], seen
        assert torch_mapped(process.pid) == []
        daemon_side.send_multipart(protocol.encode("stop", 0))
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        daemon_side.close(linger=0)
        context.term()
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert torch.equal(loaded["a"], a) and torch.equal(loaded["b"][0], b)
    for name, result in zip(("x.distcp", "s.distcp"), results[1:]):
        data = (tmp_path / name).read_bytes()
        items = [torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
                 for start, length in result["items"]]
        assert torch.equal(items[0], a) and torch.equal(items[1], b)



@pytest.fixture
def channel():
    """A writer channel in this process: (the daemon's end, the writer's end)."""
    import zmq

    context = zmq.Context()
    daemon_side, writer_side = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    daemon_side.bind("inproc://writer-cancels")
    writer_side.connect("inproc://writer-cancels")
    yield daemon_side, writer_side
    daemon_side.close(linger=0)
    writer_side.close(linger=0)
    context.term()


def previous_and_job(writer, tmp_path):
    """A file already at the path, and a torch job that would replace it."""
    path = tmp_path / "model.pt"
    path.write_bytes(b"the previous checkpoint")
    return path, WriteTorch(str(path), protocol.pack_value(protocol.TensorRef(0)),
                            [put(writer, 0, torch.ones(4))], 16)


def test_a_job_cancelled_before_the_writer_reads_it_leaves_the_path_as_it_was(
        writer, tmp_path, channel):
    # The order of a stopped daemon's resumption: the job reached the writer's channel, the
    # daemon then read the trainer's abort and sent the cancel, and only then did the
    # (SIGSTOPped) writer read its channel. The old file must stay, untouched.
    daemon_side, writer_side = channel
    path, job = previous_and_job(writer, tmp_path)
    for message_type, msg_id, body in ((job.message_type, 3, job.to_wire()),
                                       (CancelJob.message_type, 3, {}), ("stop", 0, {})):
        daemon_side.send_multipart(protocol.encode(message_type, msg_id, body))
    writer.run(writer_side)  # ready, the job's result, then the stop
    replies = [protocol.decode(daemon_side.recv_multipart()) for _ in range(2)]
    result = [r for r in replies if r.type == "result"][0]
    assert result.id == 3 and result.body["ok"] is False
    assert result.body["errno"] == errno.ECANCELED and "dropped" in result.body["error"]
    assert path.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_job_cancelled_while_it_writes_is_not_renamed_into_place(writer, tmp_path, channel):
    # The cancel comes while the writer is writing (the daemon read the abort meanwhile):
    # the file is never renamed over the old one, and no temporary is left.
    daemon_side, writer_side = channel

    class CancelledWhileWriting(ProgressReporter):
        def __call__(self, phase, bytes_done):
            if phase == "write" and not writer.inbox.cancelled:
                daemon_side.send_multipart(protocol.encode(CancelJob.message_type, self.job_id))
                assert writer_side.poll(5000)  # delivered before the writer looks again

    writer.inbox.sock, writer.progress = writer_side, CancelledWhileWriting(None)
    path, job = previous_and_job(writer, tmp_path)
    result = run(writer, job)
    assert not result.ok and result.errno == errno.ECANCELED
    assert path.read_bytes() == b"the previous checkpoint"
    assert os.listdir(tmp_path) == ["model.pt"]


def test_a_cancelled_job_sent_after_a_higher_numbered_one_is_still_dropped(
        writer, tmp_path, channel):
    # The pool holds back a job whose path is busy and sends later ones first: the writer
    # gets job 10, then job 5 and the cancel of job 5. Answering job 10 must not forget
    # the cancel of the lower-numbered job still waiting behind it.
    daemon_side, writer_side = channel
    path, job = previous_and_job(writer, tmp_path)
    other = WriteTorch(str(tmp_path / "other.pt"), protocol.pack_value(protocol.TensorRef(0)),
                       [put(writer, 4096, torch.zeros(4))], 16)
    for message_type, msg_id, body in ((other.message_type, 10, other.to_wire()),
                                       (job.message_type, 5, job.to_wire()),
                                       (CancelJob.message_type, 5, {}), ("stop", 0, {})):
        daemon_side.send_multipart(protocol.encode(message_type, msg_id, body))
    writer.run(writer_side)  # ready, job 10's result, job 5's result, then the stop
    replies = [protocol.decode(daemon_side.recv_multipart()) for _ in range(3)]
    results = {r.id: r.body for r in replies if r.type == "result"}
    assert results[10]["ok"] is True
    assert results[5]["ok"] is False and results[5]["errno"] == errno.ECANCELED
    assert path.read_bytes() == b"the previous checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "other.pt", "other.pt.ckptd-sum"]


def test_a_cancel_of_a_job_already_answered_is_not_kept(writer, tmp_path, channel):
    # The daemon may cancel a job whose result is already on its way: nothing is left to
    # drop, so the cancel is not held for ever.
    daemon_side, writer_side = channel
    writer.inbox.sock = writer_side
    path, job = previous_and_job(writer, tmp_path)
    daemon_side.send_multipart(protocol.encode(job.message_type, 7, job.to_wire()))
    message = writer.inbox.next(5000)
    assert writer.execute(message).ok
    writer.inbox.done(7)
    daemon_side.send_multipart(protocol.encode(CancelJob.message_type, 7, {}))
    assert writer_side.poll(5000)
    writer.inbox.read_ahead()
    assert writer.inbox.cancelled == set() and not writer.inbox.waiting


def ahead(job) -> dict:
    """A job's body as the daemon sends it ahead of the end of its staging."""
    return {**job.to_wire(), "ahead": True}


def test_a_job_sent_ahead_is_made_ready_and_written_on_its_start(writer, tmp_path, channel):
    # A torch job sent without its skeleton (the trainer sends that with STAGED): its file
    # is created and allocated from a guess of its size, and written whole on its start.
    daemon_side, writer_side = channel
    path = tmp_path / "ahead.pt"
    tensors = [put(writer, 0, torch.arange(5, dtype=torch.int64)), put(writer, 4096, torch.ones(3))]
    job = WriteTorch(str(path), b"", tensors, 64)
    skeleton = protocol.pack_value({"a": protocol.TensorRef(0), "b": [protocol.TensorRef(1)]})
    daemon_side.send_multipart(protocol.encode(job.message_type, 4, ahead(job)))
    writer.inbox.sock = writer_side
    writer.parked.park(4, writer.prepare(writer.inbox.next(5000), ahead=True))
    assert [n for n in os.listdir(tmp_path) if n.endswith(".ckptd-tmp")]  # made ready
    start = protocol.decode(protocol.encode(StartJob.message_type, 4,
                                            StartJob(skeleton=skeleton).to_wire()))
    result = writer.start(start)
    assert result.ok and result.size == os.path.getsize(path)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["a"], torch.arange(5)) and torch.equal(loaded["b"][0], torch.ones(3))
    assert sorted(os.listdir(tmp_path)) == ["ahead.pt", "ahead.pt.ckptd-sum"]


@pytest.mark.parametrize("ending", ["cancel", "stop"])
def test_a_job_sent_ahead_and_never_started_leaves_no_temporary(writer, tmp_path, channel,
                                                                ending):
    # Cancelled (its save stopped while staging): answered ECANCELED, its temporary gone,
    # and the job after it runs; or the writer told to stop: nothing of it stays either.
    daemon_side, writer_side = channel
    path, job = previous_and_job(writer, tmp_path)
    other = WriteItems(str(tmp_path / "next.distcp"), "next.distcp",
                       [put(writer, 4096, torch.ones(2))], 8)
    messages = [(job.message_type, 6, ahead(job))]
    messages += [(CancelJob.message_type, 6, {}), (other.message_type, 7, other.to_wire())] \
        if ending == "cancel" else []
    for message_type, msg_id, body in [*messages, ("stop", 0, {})]:
        daemon_side.send_multipart(protocol.encode(message_type, msg_id, body))
    writer.run(writer_side)
    replies = [protocol.decode(daemon_side.recv_multipart()) for _ in range(len(messages))]
    results = {r.id: r.body for r in replies if r.type == "result"}
    if ending == "cancel":
        assert results[6]["ok"] is False and results[6]["errno"] == errno.ECANCELED
        assert results[7]["ok"] is True
    else:
        assert results == {}
    assert path.read_bytes() == b"the previous checkpoint"
    assert sorted(os.listdir(tmp_path)) == ["model.pt", *(
        ["next.distcp", "next.distcp.ckptd-sum"] if ending == "cancel" else [])]


def test_a_start_of_a_job_never_held_is_answered_and_one_dropped_is_not(writer, tmp_path, channel):
    # The daemon starts job 11, whose message never reached this writer whole (answered
    # without its id): it fails now, instead of waiting for the stall timeout to replace
    # the writer. Job 12 was parked and cancelled (answered then): its start is no news.
    daemon_side, writer_side = channel
    writer.inbox.sock = writer_side
    start = protocol.decode(protocol.encode(StartJob.message_type, 11, StartJob().to_wire()))
    result = writer.start(start)
    assert result is not None and not result.ok and "never reached this writer" in result.error
    path, job = previous_and_job(writer, tmp_path)
    daemon_side.send_multipart(protocol.encode(job.message_type, 12, ahead(job)))
    writer.parked.park(12, writer.prepare(writer.inbox.next(5000), ahead=True))
    daemon_side.send_multipart(protocol.encode(CancelJob.message_type, 12, {}))
    assert writer_side.poll(5000)
    writer.inbox.read_ahead()
    writer.drop_cancelled(writer_side)
    assert protocol.decode(daemon_side.recv_multipart()).body["errno"] == errno.ECANCELED
    late = protocol.decode(protocol.encode(StartJob.message_type, 12, StartJob().to_wire()))
    assert writer.start(late) is None
    assert path.read_bytes() == b"the previous checkpoint"
