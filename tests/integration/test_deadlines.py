"""Deadlines of a save, as the daemon enforces them and operators configure and see them.

The option and its knob: ``ckptd serve --stall-timeout SECONDS`` (env
``CKPTD_STALL_TIMEOUT``) is read, checked and shown in ``ckptd status``.
"""

import os
import subprocess
import sys

import pytest


def test_stall_timeout_option_is_shown_in_status(start_daemon):
    daemon = start_daemon(extra_args=["--stall-timeout", "7.5"])
    assert daemon.status()["deadlines"]["stall_timeout_s"] == 7.5
    table = subprocess.run([sys.executable, "-m", "ckptd", "status", "--socket", daemon.socket],
                           capture_output=True, text=True, timeout=120)
    assert "fails after 7.5s without progress" in table.stdout


def test_stall_timeout_comes_from_the_environment_by_default(start_daemon):
    daemon = start_daemon(env={"CKPTD_STALL_TIMEOUT": "42", "CKPTD_STUCK_AFTER": "3"})
    deadlines = daemon.status()["deadlines"]
    assert deadlines == {**deadlines, "stall_timeout_s": 42.0, "stuck_after_s": 3.0}


@pytest.mark.parametrize("value", ["0", "-5", "soon"])
def test_stall_timeout_must_be_a_positive_number(tmp_path, value):
    result = subprocess.run(
        [sys.executable, "-m", "ckptd", "serve", "--socket", str(tmp_path / "s.sock"),
         "--stall-timeout", value], capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if k != "CKPTD_SOCKET"})
    assert result.returncode == 2
    assert "--stall-timeout" in result.stderr


def test_help_shows_the_stall_timeout_default():
    result = subprocess.run([sys.executable, "-m", "ckptd", "serve", "--help"],
                            capture_output=True, text=True, timeout=120)
    assert "--stall-timeout SECONDS" in result.stdout
    stall_help = " ".join(result.stdout.split("--stall-timeout")[1].split("--metrics")[0].split())
    assert "default: (600.0, or $CKPTD_STALL_TIMEOUT)" in stall_help and "bound method" not in stall_help
