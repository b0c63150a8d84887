"""The local store: session roots inside --local-dir, parts, commit marks, verification."""

import os

import pytest

from ckptd.checksum import ChecksumMismatchError, verify_tree
from ckptd.storage.local_store import LocalStore, LocalStoreError, PartReceiver
from ckptd.storage.roots import AllowedRoots


@pytest.fixture
def store(tmp_path):
    return LocalStore(AllowedRoots.of([str(tmp_path / "local")]))


def write_part(path: str, data: bytes) -> None:
    receiver = PartReceiver(path, len(data))
    receiver.write(0, data)
    receiver.finish()


def test_sessions_must_be_plain_names_inside_the_local_dir(store, tmp_path):
    session = store.register("job-1", str(tmp_path / "local" / "ckpt"))
    assert session.directory == str(tmp_path / "local" / "ckpt" / "job-1")
    assert os.path.isdir(session.directory)
    with pytest.raises(LocalStoreError, match="not a plain name"):
        store.register("../escape", str(tmp_path / "local"))
    with pytest.raises(LocalStoreError, match="--local-dir"):
        store.register("job", str(tmp_path / "elsewhere"))
    with pytest.raises(LocalStoreError, match="not registered"):
        store.session("never")


def test_commit_marks_the_iteration_and_drops_older_ones(store, tmp_path):
    session = store.register("s", str(tmp_path / "local"))
    for iteration in (1, 2):
        write_part(session.part_path(iteration, 0), b"part %d" % iteration)
    assert store.commit(session, 2) == [1]
    assert store.iterations(session) == [2] and store.is_committed(session, 2)
    assert verify_tree(session.iteration_dir(2)), "the marker is verifiable like every file"
    store.begin_iteration(session, 2)  # a new save of the same iteration uncommits it
    assert not store.is_committed(session, 2)


def test_inventory_verifies_parts_and_reports_corruption(store, tmp_path):
    session = store.register("s", str(tmp_path / "local"))
    path = session.part_path(3, 1)
    write_part(path, b"abcdef")
    assert [(p["owner"], p["verified"]) for p in store.inventory(session)] == [(1, True)]
    with open(path, "r+b") as f:
        f.write(b"X")
    assert [p["verified"] for p in store.inventory(session)] == [False]


def test_a_part_received_with_the_wrong_crc_is_discarded(store, tmp_path):
    session = store.register("s", str(tmp_path / "local"))
    receiver = PartReceiver(session.part_path(1, 0), 18)
    receiver.write(0, b"bytes that arrived")
    with pytest.raises(ChecksumMismatchError, match="discarded"):
        receiver.finish(expected_crc=1234)
    assert os.listdir(session.iteration_dir(1)) == []


def test_pieces_arriving_out_of_order_and_twice_make_one_verified_part(store, tmp_path):
    import zlib

    session = store.register("s", str(tmp_path / "local"))
    data = os.urandom(10_000)
    path = session.part_path(2, 0)
    receiver = PartReceiver(path, len(data))
    for offset in (8192, 0, 4096, 0):
        receiver.write(offset, data[offset:offset + 4096])
    assert receiver.received == len(data) and receiver.complete
    assert receiver.finish(zlib.crc32(data)).value == zlib.crc32(data)
    assert open(path, "rb").read() == data and verify_tree(path) == [path]
    with pytest.raises(ValueError, match="outside"):
        PartReceiver(session.part_path(3, 0), 10).write(8, b"abc")


def test_overlapping_pieces_are_never_made_durable(store, tmp_path):
    session = store.register("s", str(tmp_path / "local"))
    receiver = PartReceiver(session.part_path(4, 0), 8)
    receiver.write(0, b"abc")
    receiver.write(2, b"cdefgh")  # overlaps: the count says complete, the pieces do not
    with pytest.raises(ChecksumMismatchError, match="do not form the part"):
        receiver.finish()
    assert os.listdir(session.iteration_dir(4)) == []
