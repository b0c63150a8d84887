"""Durable writes: complete files under their final names, checksummed, nothing left over."""

import os
import subprocess

import pytest

from ckptd import knobs
from ckptd.checksum import TMP_MARKER, checksum_bytes, verify_file
from ckptd.storage.directories import make_directories
from ckptd.storage.durable import (DurableFile, remove_written, temporaries_of,
                                   write_file_atomically, write_small_file)

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")


def test_a_file_appears_complete_with_its_checksum_and_no_temporary(tmp_path):
    path = tmp_path / "new" / "dir" / "part.distcp"
    result = write_file_atomically(str(path), lambda s: s.write(b"x" * 3000))
    assert path.read_bytes() == b"x" * 3000 and result["size"] == 3000
    assert verify_file(str(path)) == checksum_bytes(b"x" * 3000, knobs.CHECKSUM.get())
    assert sorted(os.listdir(path.parent)) == ["part.distcp", "part.distcp.ckptd-sum"]


def test_a_failed_write_leaves_nothing_and_keeps_the_previous_file(tmp_path):
    path = tmp_path / "model.pt"
    write_file_atomically(str(path), lambda s: s.write(b"old"))

    def broken(stream):
        stream.write(b"half of the new")
        raise RuntimeError("serializer crashed")

    with pytest.raises(RuntimeError, match="serializer crashed"):
        write_file_atomically(str(path), broken)
    assert path.read_bytes() == b"old" and verify_file(str(path)).size == 3
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TMP_MARKER)]


@pytest.mark.parametrize("fails_at", ["fsync", "commit"])
def test_a_commit_stopped_after_its_record_was_written_leaves_the_old_file_and_record(
        tmp_path, fails_at):
    # The record is written and fsynced while the file's fsync runs, before either is
    # renamed: a commit stopped then (the writer's cancel check at "commit", raised from
    # the progress report; or anything at "fsync") leaves the old file with its own
    # record, and no temporary of either.
    path = tmp_path / "model.pt"
    write_file_atomically(str(path), lambda s: s.write(b"old"))

    def progress(phase, nbytes):
        if phase == fails_at:
            raise OSError(125, "the daemon dropped this save")

    with pytest.raises(OSError, match="dropped"):
        write_file_atomically(str(path), lambda s: s.write(b"the new bytes"), progress=progress)
    assert path.read_bytes() == b"old" and verify_file(str(path)).size == 3
    assert sorted(os.listdir(tmp_path)) == ["model.pt", "model.pt.ckptd-sum"]


def test_temporaries_are_hidden_attributed_and_unguessable(tmp_path):
    path = str(tmp_path / "f")
    first, second = DurableFile(path), DurableFile(path)
    try:
        assert first.tmp_name != second.tmp_name
        for durable in (first, second):
            assert durable.tmp_name.startswith(f".f.{os.getpid()}.")
            assert durable.tmp_name.endswith(TMP_MARKER)
        assert len(temporaries_of(path, os.getpid())) == 2
    finally:
        first.discard()
        second.discard()
    assert temporaries_of(path) == []


def test_small_files_are_replaced_whole(tmp_path):
    path = tmp_path / "committed"
    write_small_file(str(path), b"1\n", checksum=True)
    write_small_file(str(path), b"2\n", checksum=True)
    assert path.read_bytes() == b"2\n" and verify_file(str(path)).size == 2
    with pytest.raises(FileNotFoundError):
        write_small_file(str(tmp_path / "missing" / "x"), b"", operator_path=True)


def test_make_directories_creates_only_what_is_missing(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    assert make_directories(str(target)) == [str(tmp_path / "a"), str(tmp_path / "a" / "b"),
                                             str(target)]
    assert make_directories(str(target)) == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError):
        make_directories(str(tmp_path / "file" / "sub"))


def leave_temporary_behind(path: str) -> None:
    """A writer process that dies (SIGKILL-like ``_exit``) in the middle of a file."""
    import subprocess
    import sys

    code = ("import os, sys; from ckptd.storage.durable import DurableFile\n"
            "f = DurableFile(sys.argv[1]); f.stream.write(b'half'); os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code, path]).returncode == 9


def test_remove_written_takes_the_record_and_dead_leftovers_but_not_live_ones(tmp_path):
    path = str(tmp_path / "f")
    write_file_atomically(path, lambda s: s.write(b"data"))
    leave_temporary_behind(path)
    live = DurableFile(path)  # a writer still at work on the same name
    remove_written(path)
    assert os.listdir(tmp_path) == [live.tmp_name]
    live.discard()


def test_a_sweep_removes_only_what_no_writer_holds(tmp_path):
    from ckptd.storage.leftovers import sweep_temporaries

    target = tmp_path / "step" / "x.distcp"
    make_directories(str(target.parent))
    leave_temporary_behind(str(target))
    live = DurableFile(str(target))
    os.symlink(tmp_path, target.parent / f".x.distcp.1.planted{TMP_MARKER}")
    removed = sweep_temporaries(str(tmp_path), recursive=True)
    assert len(removed) == 1 and live.tmp_name not in removed[0]
    assert sorted(os.listdir(target.parent)) == sorted([live.tmp_name,
                                                        f".x.distcp.1.planted{TMP_MARKER}"])
    live.discard()


@needs_root
def test_a_file_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        with open(mount / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass
        with pytest.raises(OSError):
            write_small_file(str(mount / "part"), b"x" * 8192, checksum=True)
        assert sorted(os.listdir(mount)) == ["filler"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


# ------------------------------------------------------------------ planted symbolic links

@pytest.fixture
def victim(tmp_path):
    """A file outside the checkpoint directory that a planted link points at."""
    path = tmp_path / "victim"
    path.write_bytes(b"precious")
    return path


def test_links_planted_at_the_final_names_are_replaced_not_followed(tmp_path, victim):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("model.pt", "model.pt.ckptd-sum"):
        os.symlink(victim, ckpt / name)
    write_file_atomically(str(ckpt / "model.pt"), lambda s: s.write(b"weights"))
    assert victim.read_bytes() == b"precious"
    assert not os.path.islink(ckpt / "model.pt") and (ckpt / "model.pt").read_bytes() == b"weights"
    assert verify_file(str(ckpt / "model.pt")).size == 7


def test_a_directory_swapped_for_a_link_after_the_check_is_refused(tmp_path, victim):
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    ckpt.mkdir()
    elsewhere.mkdir()
    os.symlink(elsewhere, ckpt / "step_1")  # planted between the path check and the write
    with pytest.raises(OSError, match="step_1.*symbolic link|symbolic link") as info:
        write_file_atomically(str(ckpt / "step_1" / "__0_0.distcp"), lambda s: s.write(b"x"))
    assert info.value.errno == 40 and str(ckpt / "step_1") in str(info.value)
    assert os.listdir(elsewhere) == []


def test_a_temporary_name_that_exists_is_never_reused(tmp_path, victim, monkeypatch):
    from ckptd.storage import durable

    real, tokens = durable.secrets.token_hex, ["planted00000", "fresh0000000"]
    monkeypatch.setattr(durable.secrets, "token_hex", lambda n: tokens.pop(0) if tokens else real(n))
    planted = tmp_path / f".model.pt.{os.getpid()}.planted00000{TMP_MARKER}"
    os.symlink(victim, planted)
    write_file_atomically(str(tmp_path / "model.pt"), lambda s: s.write(b"weights"))
    assert victim.read_bytes() == b"precious" and os.path.islink(planted)
    assert (tmp_path / "model.pt").read_bytes() == b"weights"
