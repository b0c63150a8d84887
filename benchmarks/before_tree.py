"""Run ckptd's daemon and writers from an earlier commit, beside this tree's trainer side.

For benchmarks that show a change to the daemon or its writers before and after in one
run: :func:`exported` writes commit REV's files (``git archive``) to a temporary directory,
and processes started inside :func:`code_of` import ckptd from there. The trainer's side
(this process) stays this tree's, so REV must speak the same protocol.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager


@contextmanager
def code_of(tree: str | None):
    """Processes started in the block run ckptd from ``tree`` (``python -m`` puts the
    working directory first on the path; the daemon's writers inherit both)."""
    if tree is None:
        yield
        return
    here, path = os.getcwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree)
    os.environ["PYTHONPATH"] = tree
    try:
        yield
    finally:
        os.chdir(here)
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


@contextmanager
def exported(rev: str):
    """Commit ``rev`` of this repository exported to a temporary directory (None: no rev)."""
    if not rev:
        yield None
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tree = tempfile.mkdtemp(prefix="ckpt-writepath-before-")
    try:
        archive = subprocess.run(["git", "-C", repo, "archive", rev], capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)
