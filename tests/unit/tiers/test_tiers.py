"""The tier's pieces on their own: the copy, the backoff, the stage budget and journal, the
layout prediction the hand-over relies on. Real files in a temporary directory."""

from __future__ import annotations

import io
import os
import types

import pytest
import torch

from ckptd import knobs
from ckptd.storage.durable import write_small_file
from ckptd.storage.layout import check_prediction, predict_placements, tensor_archive_size
from ckptd.tiers.copy import CopyError, CopyTask, FlushFile, present_at_target
from ckptd.tiers.flusher import backoff
from ckptd.tiers.stage import StageDir


def local_copy(tmp_path, data: bytes) -> FlushFile:
    local = str(tmp_path / "stage" / "f.distcp")
    write_small_file(local, data, checksum=True)
    from ckptd.checksum import checksum_bytes
    crc = checksum_bytes(data, knobs.CHECKSUM.get()).value  # as the writer recorded it
    return FlushFile(local, str(tmp_path / "target" / "f.distcp"), len(data), crc)


def test_a_copy_reaches_the_target_with_its_checksum_record(tmp_path):
    data = os.urandom(300_000)
    with knobs.override(FLUSH_CHUNK_BYTES=64 << 10):
        CopyTask(local_copy(tmp_path, data), 1).run()
    target = tmp_path / "target" / "f.distcp"
    assert target.read_bytes() == data and present_at_target(str(target), True)
    assert [n for n in os.listdir(tmp_path / "target") if "tmp" in n] == []


def test_a_damaged_local_copy_fails_fast_and_leaves_nothing_at_the_target(tmp_path):
    file = local_copy(tmp_path, os.urandom(100_000))
    with open(file.local, "r+b") as f:
        f.seek(5000)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CopyError) as raised:
        CopyTask(file, 1).run()
    assert raised.value.fail_fast and "corrupt" in str(raised.value)
    assert os.listdir(tmp_path / "target") == []


def test_a_copy_waits_for_the_files_its_commit_needs(tmp_path):
    from ckptd.tiers.copy import NotYet

    file = local_copy(tmp_path, b"metadata")
    with pytest.raises(NotYet):
        CopyTask(file, 1, requires=[(str(tmp_path / "target" / "other.distcp"), True)]).run()
    assert not os.path.exists(file.target)


def test_backoff_doubles_from_the_start_up_to_the_cap():
    with knobs.override(FLUSH_RETRY_START=10.0, FLUSH_RETRY_CAP=600.0):
        assert [backoff(a) for a in (1, 2, 3, 4)] == [10.0, 20.0, 40.0, 80.0]
        assert backoff(30) == 600.0


def test_the_stage_budget_and_journal(tmp_path):
    stage = StageDir(str(tmp_path / "stage"), budget=1000)
    assert stage.fits(1000) and not stage.fits(1001)
    stage.reserve("a", 600)
    assert not stage.fits(500) and stage.used_bytes == 600
    assert stage.release("a") and not stage.release("a")
    stage.record("a", {"kind": "save", "files": []})
    os.makedirs(stage.local_dir("a"))
    os.makedirs(stage.local_dir("orphan"))
    assert StageDir(str(tmp_path / "stage"), None).entries() == {"a": {"kind": "save", "files": []}}
    stage.sweep({"a"})
    assert os.listdir(stage.saves_dir) == ["a"]


@pytest.mark.parametrize("dtype,shape", [("float32", (100, 10)), ("bfloat16", (3,)),
                                         ("int64", ()), ("float32", (0, 3)), ("bool", (7,)),
                                         ("float16", (1 << 12, 300))])
def test_the_predicted_archive_size_is_what_the_writer_writes(dtype, shape):
    from ckptd.storage.layout import storage_alignment
    from ckptd.storage.torch_format import DEFAULT_ALIGNMENT
    from ckptd.storage.torch_format import raw_tensor, write_tensor_file

    tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
    buffer = io.BytesIO()
    torch.save(tensor, buffer)  # stock files are torch's bytes exactly
    assert tensor_archive_size(dtype, shape, stock=True) == len(buffer.getvalue())
    written = io.BytesIO()
    alignment, record_alignment = storage_alignment(tensor.nbytes, False), DEFAULT_ALIGNMENT
    write_tensor_file(written, raw_tensor(tensor.numpy().tobytes() if dtype != "bfloat16"
                                          else tensor.view(torch.int16).numpy().tobytes(),
                                          dtype, list(shape)),
                      alignment=alignment, record_alignment=record_alignment)
    assert tensor_archive_size(dtype, shape) == len(written.getvalue())
    written.seek(0)
    assert torch.equal(torch.load(written, weights_only=True), tensor)


def test_placements_follow_the_writers_rule_and_are_checked():
    buffers = [["float32", [10], 40], ["bytes", [7], 7], ["float32", [20000], 80000],
               ["float32", [10], 40]]
    predicted = predict_placements(buffers, [["f", [0, 1, 2, 3]]])
    size, large = tensor_archive_size("float32", (10,)), tensor_archive_size("float32", (20000,))
    third = -(-(size + 7) // 4096) * 4096  # a large tensor's archive starts on the next page
    assert predicted == {"f": [[0, size], [size, 7], [third, large],
                               [third + large, size]]}  # a small one right after
    assert check_prediction(predicted, "f", predicted["f"]) is None
    assert "not where the hand-over said" in check_prediction(predicted, "f", [[0, size]])


def test_a_copy_over_a_file_keeps_it_until_its_save_is_settled(tmp_path):
    from ckptd.storage.previous import previous_name
    from ckptd.tiers.settle import settle

    target = tmp_path / "target" / "f.distcp"
    for failed, expected in ((False, b"new"), (True, b"old")):
        write_small_file(str(target), b"old", checksum=True)
        file = local_copy(tmp_path, b"new")
        file.previous = previous_name(file.target)
        task = CopyTask(file, 1)
        task.start(lambda task, error: None)
        settle([file], [task], failed).join(30)  # waits for the copy, then settles
        assert file.kept and target.read_bytes() == expected
        assert present_at_target(str(target), True)
        assert sorted(os.listdir(target.parent)) == ["f.distcp", "f.distcp.ckptd-sum"]


def test_no_copy_starts_to_a_target_while_it_is_settled(tmp_path):
    import threading
    import time

    import zmq

    from ckptd.tiers.flusher import Flusher, FlushJob

    release = threading.Event()
    settling = threading.Thread(target=release.wait, daemon=True)
    settling.start()
    context = zmq.Context()
    flusher = Flusher(context, stall_timeout=60)
    try:
        file = local_copy(tmp_path, b"new")
        flusher.hold([file.target], settling)
        job = FlushJob("k", file.target, [file], time.time() + 60, lambda job, failure: None)
        flusher.submit(job)
        assert flusher.running() == 0
        assert "earlier save's copy" in job.progress()["last_error"]
        release.set()
        settling.join(10)
        flusher.tick()
        assert flusher.running() == 1 and len(job.states[0].tasks) == 1
        job.states[0].tasks[0].thread.join(10)  # it posts its result before the mailbox goes
    finally:
        flusher.close()
        context.term()


def _previous_daemon_renamed(tmp_path, old: bytes | None) -> FlushFile:
    """A daemon's attempt kept ``old`` aside (if any) and renamed its file onto the target;
    the daemon then died: what its successor resumes from the journal."""
    from ckptd.storage.previous import previous_name

    target = tmp_path / "target" / "f.distcp"
    if old is not None:
        write_small_file(str(target), old, checksum=True)
    file = local_copy(tmp_path, b"new")
    file.previous = previous_name(file.target)
    CopyTask(file, 1).run()
    assert target.read_bytes() == b"new"
    return FlushFile.from_json(file.to_json()).recall_attempts()


def _damage(file: FlushFile) -> None:
    """Flip the local copy's bytes (not its record): an attempt keeps, copies, then fails."""
    with open(file.local, "r+b") as f:
        f.write(b"NEW")


@pytest.mark.parametrize("resumed_attempt", ["fails", "none"])
@pytest.mark.parametrize("old", [b"old", None], ids=["overwrite", "new-path"])
def test_a_resumed_save_that_fails_puts_back_what_the_dead_daemon_replaced(
        tmp_path, resumed_attempt, old):
    """The dead daemon's attempt renamed the save's file onto the target; the resumed save
    fails (its attempt fails after keeping, or its deadline passed before any attempt):
    the target holds the previous file and record again, or nothing where there was none."""
    from ckptd.tiers.settle import settle

    file = _previous_daemon_renamed(tmp_path, old)
    tasks = []
    if resumed_attempt == "fails":
        _damage(file)
        task = CopyTask(file, 1)
        task.start(lambda task, error: None)
        tasks.append(task)
    settle([file], tasks, True).join(30)
    target = tmp_path / "target" / "f.distcp"
    if old is None:
        assert os.listdir(target.parent) == []
    else:
        assert target.read_bytes() == old and present_at_target(str(target), True)
        assert sorted(os.listdir(target.parent)) == ["f.distcp", "f.distcp.ckptd-sum"]


class _Tier:
    """What :class:`ckptd.tiers.commits.TierCommits` uses of its service: a real stage
    directory and settlements; the flusher only records jobs, and settles at once."""

    def __init__(self, stage):
        from ckptd.tiers.settle import Settlements

        self.stage, self.retention, self.jobs = stage, None, []
        self.flusher = self
        self.settlements = Settlements(self)

    def submit(self, job):
        self.jobs.append(job)

    def cancel(self, key):
        return None

    def hold(self, targets, thread):
        thread.join(30)


def test_a_resumed_commit_given_up_puts_back_the_previous_metadata(tmp_path):
    """A daemon renamed a checkpoint's new ``.metadata`` over the previous one, then died
    before the commit was done; its successor resumes the commit from the journal and
    gives it up: the previous ``.metadata`` is back, and no kept link is left behind."""
    from ckptd.tiers.commits import TierCommits

    directory = tmp_path / "target" / "ckpt"
    metadata = directory / ".metadata"
    write_small_file(str(metadata), b"previous metadata", checksum=True)
    stage = StageDir(str(tmp_path / "stage"), None)
    dead = _Tier(stage)
    TierCommits(dead)._new(str(metadata), b"new metadata", [], True)
    CopyTask(dead.jobs[0].files[0], 1).run()  # renamed, then the daemon was killed
    assert metadata.read_bytes() == b"new metadata"

    successor = _Tier(stage)
    commits = TierCommits(successor)
    for key, entry in stage.entries().items():
        commits.resume(key, entry)
    commits.end(commits.pending[str(metadata)], "the flush deadline passed", None)
    assert metadata.read_bytes() == b"previous metadata"
    assert present_at_target(str(metadata), True)
    assert sorted(os.listdir(directory)) == [".metadata", ".metadata.ckptd-sum"]


class _Endpoint:
    """Records what the daemon sends back on a call."""

    def __init__(self):
        self.sent = []

    def send(self, routing_id, msg_type, msg_id, body):
        self.sent.append((routing_id, msg_type, msg_id, body))


def test_a_stage_waiting_for_the_budget_is_refused_once_its_trainer_gave_up_on_it(tmp_path):
    """Two STAGEs wait for a full stage budget; an ABORT names one of them (its trainer
    gave up waiting for the reply): that one is refused at once and never admitted, the
    other (and another connection's STAGE with the same message id) waits on."""
    from ckptd.protocol import ErrorCode, MessageType, Stage
    from ckptd.server.endpoint import DEFERRED, Call
    from ckptd.tiers.service import TierService

    stage = StageDir(str(tmp_path / "stage"), budget=1 << 20)
    stage.reserve("earlier", 1 << 20)  # a save still flushing holds the whole budget
    tier = TierService(object(), stage, "wait")
    endpoint = _Endpoint()
    body = Stage(format="torch", path="/ckpt/x.pt", buffers=[["uint8", [4096], 4096]])
    calls = [Call(endpoint, routing, msg_id) for routing, msg_id in
             ((b"a", 7), (b"a", 8), (b"b", 7))]
    for call in calls:
        assert tier.admission.admit(call, body, start=None) is DEFERRED
    tier.admission.drop(b"a", {7})
    assert [parked.call for parked in tier.admission.waiting] == calls[1:]
    [(routing, kind, msg_id, error)] = endpoint.sent
    assert (routing, kind, msg_id, error["code"]) == (b"a", MessageType.ERROR, 7,
                                                       ErrorCode.ABORTED)


def test_a_refused_waiting_stage_lets_those_behind_it_in_and_gives_back_its_handles(tmp_path):
    """First come, first admitted: a STAGE that leaves the queue refused (its trainer gave
    up, or it waited too long) must not keep a later one that fits parked behind it; and
    each STAGE the service refuses hands back what it brought (``refused``: its CUDA
    handles, which the trainer counts on the daemon to release), one that starts does not."""
    from ckptd.protocol import ErrorCode, Stage
    from ckptd.server.endpoint import DEFERRED, Call
    from ckptd.tiers.service import TierService

    stage = StageDir(str(tmp_path / "stage"), budget=1 << 20)
    stage.reserve("earlier", 600 << 10)  # a save still flushing holds most of the budget
    daemon = types.SimpleNamespace(incarnation="i", table=types.SimpleNamespace(next_id=1))
    tier = TierService(daemon, stage, "wait")
    endpoint = _Endpoint()
    large = Stage(format="torch", path="/ckpt/a.pt", buffers=[["uint8", [800 << 10], 800 << 10]])
    small = Stage(format="torch", path="/ckpt/b.pt", buffers=[["uint8", [4096], 4096]])
    started, refused = [], []

    def start(call, body):
        started.append(call.msg_id)
        return DEFERRED

    for msg_id, body in ((7, large), (8, small), (9, large), (10, small)):
        call = Call(endpoint, b"a", msg_id, received_at=100.0 if msg_id < 9 else 200.0)
        assert tier.admission.admit(call, body, start, refused=lambda m=msg_id: refused.append(m)) \
            is DEFERRED
    tier.admission.drop(b"a", {7})
    assert (started, refused) == ([8], [7]), "the small STAGE behind the dropped one fits"
    gone = Call(endpoint, b"gone", 1, received_at=200.0)  # a trainer that exits while parked
    tier.admission.admit(gone, large, start, refused=lambda: refused.append("gone"))
    tier.admission.drop_connection(b"gone", "trainer process 4242 exited during the save")
    assert refused == [7, "gone"] and gone not in [p.call for p in tier.admission.waiting]
    tier.admission.expire(now=150.0 + knobs.STAGE_TIMEOUT.get(), limit=knobs.STAGE_TIMEOUT.get())
    assert [parked.call.msg_id for parked in tier.admission.waiting] == [9, 10]
    tier.admission.expire(now=250.0 + knobs.STAGE_TIMEOUT.get(), limit=knobs.STAGE_TIMEOUT.get())
    assert (started, refused, tier.admission.waiting) == ([8], [7, "gone", 9, 10], [])
    codes = [body["code"] for _, _, _, body in endpoint.sent]
    assert codes == [ErrorCode.ABORTED, ErrorCode.ABORTED, ErrorCode.STAGE_FULL,
                     ErrorCode.STAGE_FULL]


def test_every_refusal_of_the_stage_budget_hands_back_what_the_stage_brought(tmp_path):
    """Too large for the budget, refused by the ``refuse`` policy, parked when the daemon
    stops: each refusal runs ``refused()`` once and answers its call once; a parked STAGE
    whose admission fails with a daemon bug is answered (``internal``) and the queue goes on."""
    from ckptd.protocol import ErrorCode, Stage
    from ckptd.server.endpoint import DEFERRED, Call, RequestError
    from ckptd.tiers.service import TierService

    daemon = types.SimpleNamespace(incarnation="i", table=types.SimpleNamespace(next_id=1))
    endpoint = _Endpoint()
    small = Stage(format="torch", path="/ckpt/b.pt", buffers=[["uint8", [4096], 4096]])
    huge = Stage(format="torch", path="/ckpt/c.pt", buffers=[["uint8", [2 << 20], 2 << 20]])
    most = Stage(format="torch", path="/ckpt/d.pt", buffers=[["uint8", [900 << 10], 900 << 10]])
    refused = []

    def admit(tier, msg_id, body, start=None):
        return tier.admission.admit(Call(endpoint, b"a", msg_id), body, start,
                                    refused=lambda: refused.append(msg_id))

    for policy in ("wait", "refuse"):
        stage = StageDir(str(tmp_path / policy), budget=1 << 20)
        stage.reserve("earlier", 1 << 20)
        tier = TierService(daemon, stage, policy)
        with pytest.raises(RequestError, match="can never fit"):
            admit(tier, 1, huge)
        if policy == "refuse":
            with pytest.raises(RequestError, match="is full"):
                admit(tier, 2, small)
        else:
            def broken(call, body):
                raise KeyError("a daemon bug")
            assert admit(tier, 2, small, broken) is DEFERRED
            assert admit(tier, 3, small, lambda call, body: DEFERRED) is DEFERRED
            assert admit(tier, 4, most) is DEFERRED
            stage.release("earlier")
            tier.admission.budget_freed()  # 2 fails inside, 3 starts, 4 no longer fits
            assert [p.call.msg_id for p in tier.admission.waiting] == [4]
            tier.admission.close()
            assert tier.admission.waiting == []
    assert refused == [1, 2, 4, 1, 2]
    codes = [body["code"] for _, _, _, body in endpoint.sent]
    assert ErrorCode.INTERNAL in codes and codes.count(ErrorCode.INTERNAL) == 1
