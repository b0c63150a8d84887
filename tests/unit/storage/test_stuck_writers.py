"""Stuck writers kept until they exit, with a real process standing in for the writer."""

import logging
import subprocess
import sys

from ckptd import protocol
from ckptd.storage.jobs import WriteJob, WriteTorch
from ckptd.storage.previous import kept_record_name, previous_name
from ckptd.storage.stalls import StuckWriters


def test_shutdown_with_a_stuck_writer_names_where_the_replaced_file_is_kept(tmp_path, caplog):
    # The daemon stops while a writer given up on may still rename over a previous file:
    # that file cannot be put back now, and the next daemon's sweep removes the link it
    # is kept under, so the operator is told at error level where it is and for which path.
    path = str(tmp_path / "last.pt")
    kept = previous_name(path)
    job = WriteJob(WriteTorch(path, protocol.pack_value(None), [], 0, previous=kept),
                   lambda job, result: None, on_stuck=lambda job, pid: lambda: None)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    closed = []
    stuck = StuckWriters()
    try:
        stuck.add(process, job, lambda: closed.append(True))
        with caplog.at_level(logging.WARNING, logger="ckptd.storage.stalls"):
            stuck.abandon()
    finally:
        process.kill()
        process.wait()
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, caplog.text
    assert path in errors[0] and kept in errors[0] and kept_record_name(kept) in errors[0]
    assert closed == [True] and stuck.writers == []
