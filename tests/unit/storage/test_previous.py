"""Keeping a replaced file aside, and putting it back, on real files."""

import os

from ckptd.checksum import sidecar_path, verify_file
from ckptd.storage.durable import write_file_atomically
from ckptd.storage.previous import (drop_previous, keep_aside, previous_name, restore_previous,
                                    restore_previous_of)


def write(path, data: bytes) -> list:
    return write_file_atomically(str(path), lambda f: f.write(data))["file_id"]


def names(directory) -> list:
    return sorted(os.listdir(directory))


def assert_holds(path, data: bytes) -> None:
    """``path`` holds ``data`` with its own record, and nothing is left beside it."""
    assert path.read_bytes() == data
    verify_file(str(path))
    assert names(path.parent) == [path.name, path.name + ".ckptd-sum"]


def overwrite(path, new: bytes = b"new") -> tuple[str, list]:
    """``path`` holds b"old"; a save keeps it aside and commits ``new`` over it."""
    write(path, b"old")
    previous = previous_name(str(path))
    assert keep_aside(str(path), previous)
    return previous, write(path, new)


def test_nothing_is_kept_for_a_new_path_or_a_new_directory(tmp_path):
    assert not keep_aside(str(tmp_path / "new.pt"), previous_name(str(tmp_path / "new.pt")))
    missing = str(tmp_path / "no" / "dir" / "new.pt")
    assert not keep_aside(missing, previous_name(missing))
    assert names(tmp_path) == []


def test_a_failed_overwrite_puts_the_old_file_and_its_record_back(tmp_path):
    path = tmp_path / "last.pt"
    previous, new_id = overwrite(path)
    assert restore_previous(str(path), previous, new_id)
    assert_holds(path, b"old")


def test_a_done_overwrite_drops_what_it_kept(tmp_path):
    path = tmp_path / "last.pt"
    previous, _ = overwrite(path)
    drop_previous(previous)
    assert_holds(path, b"new")


def test_a_later_saves_file_is_never_replaced(tmp_path):
    path = tmp_path / "last.pt"
    previous, ours = overwrite(path, b"aborted")
    write(path, b"later")  # another save of the path committed after ours
    assert not restore_previous(str(path), previous, ours)
    assert path.read_bytes() == b"later"
    assert names(tmp_path) == ["last.pt", "last.pt.ckptd-sum"]


def test_a_writer_that_died_before_its_rename_leaves_the_old_file_alone(tmp_path):
    path = tmp_path / "last.pt"
    old_id = write(path, b"old")
    previous = previous_name(str(path))
    keep_aside(str(path), previous)
    assert not restore_previous(str(path), previous, None)
    assert path.read_bytes() == b"old" and list(os.stat(path)[1:2]) == old_id[1:]
    assert names(tmp_path) == ["last.pt", "last.pt.ckptd-sum"]


def test_a_writer_that_died_after_its_rename_is_rolled_back(tmp_path):
    path = tmp_path / "last.pt"
    previous, _ = overwrite(path)
    assert restore_previous(str(path), previous, None)  # no file id: its writer never answered
    assert path.read_bytes() == b"old"
    verify_file(str(path))


def test_an_old_file_without_a_record_gets_no_stale_record_back(tmp_path):
    path = tmp_path / "stock.distcp"
    path.write_bytes(b"old")  # as stock DCP writes: no ckptd record
    previous = previous_name(str(path))
    keep_aside(str(path), previous)
    new_id = write(path, b"new")  # ckptd's file comes with a record
    assert restore_previous(str(path), previous, new_id)
    assert path.read_bytes() == b"old"
    assert names(tmp_path) == ["stock.distcp"]


def test_a_path_under_a_file_is_nothing_to_keep_or_put_back(tmp_path):
    # A save to "a file's child" fails in its writer; winding it up must not raise in the
    # serve loop, or the failure never reaches the trainers (they waited to the deadline).
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"not a directory")
    path = str(blocker / "model.pt")
    previous = previous_name(path)
    assert keep_aside(path, previous) is False
    assert restore_previous(path, previous, None) is False
    drop_previous(previous)
    assert blocker.read_bytes() == b"not a directory"


def test_a_record_renamed_before_a_file_that_never_was_is_put_back(tmp_path):
    # A writer (or a tiered copy) renames the record first: given up while its file's
    # rename was still to come, it leaves the old file with the failed save's record.
    path = tmp_path / "last.pt"
    write(path, b"old")
    previous = previous_name(str(path))
    assert keep_aside(str(path), previous)
    write(tmp_path / "new.pt", b"new")  # the failed save's record, renamed into place:
    os.replace(sidecar_path(str(tmp_path / "new.pt")), sidecar_path(str(path)))
    os.unlink(tmp_path / "new.pt")
    assert not restore_previous(str(path), previous, None)
    assert_holds(path, b"old")


def test_any_of_several_attempts_files_is_rolled_back_and_no_other(tmp_path):
    path = tmp_path / "last.pt"
    previous, second = overwrite(path, b"second attempt")
    assert restore_previous_of(str(path), previous, [[0, 0], second])
    assert_holds(path, b"old")
    previous, _ = overwrite(path, b"a later save")
    assert not restore_previous_of(str(path), previous, [second])
    assert_holds(path, b"a later save")
