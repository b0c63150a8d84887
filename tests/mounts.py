"""A test fixture: real mounts (root only, skipped elsewhere), unmounted after the test.

Import ``mounted`` into a test module to use it (a conftest beside the tests would shadow
tests/conftest.py, which tests import helpers from)."""

from __future__ import annotations

import os
import subprocess

import pytest


@pytest.fixture
def mounted(tmp_path):
    """``mounted(fstype, options) -> path``: a real mount, unmounted after the test."""
    mounts = []

    def mount(fstype: str, options: str) -> str:
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs or hugetlbfs needs root")
        path = tmp_path / f"m{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", fstype, "-o", options, f"hugepool-{fstype}",
                               str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount {fstype} -o {options} here: {done.stderr.strip()}")
        mounts.append(path)
        return str(path)

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
