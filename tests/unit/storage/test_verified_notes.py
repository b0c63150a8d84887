"""Notes of verified local parts: trusted only for the very file and record they name."""

import json
import os

from ckptd.checksum import VERIFIED_SUFFIX, verify_tree
from ckptd.storage.durable import write_small_file
from ckptd.storage.verified_notes import drop_note, note_vouches_for, write_note


def part(tmp_path, data: bytes = b"x" * 5000) -> str:
    path = str(tmp_path / "rank_0.part")
    write_small_file(path, data, checksum=True)
    return path


def test_a_note_vouches_for_the_file_it_was_written_for(tmp_path):
    path = part(tmp_path)
    assert not note_vouches_for(path, os.stat(path))
    write_note(path)
    assert note_vouches_for(path, os.stat(path))
    assert verify_tree(str(tmp_path)) == [path]  # a note is no checkpoint file


def test_a_rewritten_or_replaced_file_or_a_changed_record_is_not_vouched_for(tmp_path):
    path = part(tmp_path)
    write_note(path)
    info = os.stat(path)
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert not note_vouches_for(path, os.stat(path))
    path = part(tmp_path, b"y" * 5000)  # same name and size, new inode and record
    assert not note_vouches_for(path, os.stat(path))
    write_note(path)
    with open(path + ".ckptd-sum", "w") as f:  # a record that says something else
        f.write(json.dumps({"algorithm": "crc32", "value": "00000000", "size": 5000}))
    assert not note_vouches_for(path, os.stat(path))


def test_unreadable_notes_and_dropped_notes_vouch_for_nothing(tmp_path):
    path = part(tmp_path)
    with open(path + VERIFIED_SUFFIX, "w") as f:
        f.write("{not json")
    assert not note_vouches_for(path, os.stat(path))
    write_note(path)
    drop_note(path)
    assert not os.path.exists(path + VERIFIED_SUFFIX)
    assert not note_vouches_for(path, os.stat(path))


def test_a_note_is_written_without_fsync_and_a_note_a_crash_cut_short_vouches_for_nothing(
        tmp_path, monkeypatch):
    """Notes are written on the daemon's serve loop: an fsync there (file and directory,
    per part) would stall every client behind a slow or hung disk. A note lost or left
    empty or cut short by a crash only costs a full read of the part."""
    path = part(tmp_path)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    write_note(path)
    assert synced == []
    assert note_vouches_for(path, os.stat(path))
    whole = open(path + VERIFIED_SUFFIX, "rb").read()
    for cut in (0, len(whole) // 2, len(whole) - 1):
        with open(path + VERIFIED_SUFFIX, "wb") as f:
            f.write(whole[:cut])
        assert not note_vouches_for(path, os.stat(path))
