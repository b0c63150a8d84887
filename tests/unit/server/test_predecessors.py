"""Leftovers of a predecessor still exiting when its successor starts are swept later.

A journal names a real process still running and holding its temporary's lock, as a
writer of a killed daemon does until it has finished dying; its temporary stays, and so
does the journal (removing it then left the temporary to nobody, ever), until that
process is gone; then the next sweep of the housekeeping removes both.
"""

from __future__ import annotations

import os
import subprocess

from conftest import hold_lock

from ckptd import knobs
from ckptd.checksum import TMP_MARKER
from ckptd.server.predecessors import PredecessorSweeper


def test_a_predecessor_still_exiting_is_swept_once_it_is_gone(tmp_path):
    runtime, written = tmp_path / "run", tmp_path / "ckpt"
    runtime.mkdir()
    written.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    temporary = written / f".model.pt.4242.0123456789ab{TMP_MARKER}"
    temporary.write_bytes(b"half a file")
    # the predecessor's writer, still exiting: it holds its temporary's lock
    writer = hold_lock(temporary)
    journal = runtime / f"ckptd.{gone.pid}.dirs"
    journal.write_text(f"D {written}\nP {writer.pid}\n")
    pools = tmp_path / "pools"  # the configured pool directory, not /dev/shm
    pools.mkdir()
    dead_pool = pools / f"ckptd-{os.getuid()}-{gone.pid}-0badc0de"
    dead_pool.write_bytes(b"pool")
    sweeper = PredecessorSweeper(str(runtime), str(pools))
    try:
        sweeper.sweep()
        assert not dead_pool.exists(), "the dead daemon's pool in the pool directory is swept"
        assert temporary.exists() and journal.exists(), "nothing of a live owner is touched"
        assert sweeper.pending and sweeper.waiting_journals == [gone.pid]
    finally:
        writer.kill()
        writer.wait()
    with knobs.override(LEFTOVER_SWEEP_INTERVAL=0.0):
        sweeper._next_at = 0.0  # the interval has passed
        sweeper.tick()
    assert not temporary.exists() and not journal.exists()
    assert sweeper.waiting_journals == []



def test_a_pool_left_in_the_default_directory_is_swept_after_a_change_of_pool_dir(tmp_path):
    """A daemon SIGKILLed before the operator moved pools to a huge-page tmpfs left its pool
    in /dev/shm; no later daemon makes pools there, so the sweep looks there too."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    pools, runtime = tmp_path / "pools", tmp_path / "run"
    pools.mkdir()
    runtime.mkdir()
    left = os.path.join(knobs.POOL_DIR.default, f"ckptd-{os.getuid()}-{gone.pid}-5eed5eed")
    with open(left, "wb") as f:
        f.write(b"pool")
    try:
        PredecessorSweeper(str(runtime), str(pools)).sweep()
        assert not os.path.exists(left)
    finally:
        if os.path.exists(left):
            os.unlink(left)
