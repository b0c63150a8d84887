"""deploy/slurm/prolog.sh and epilog.sh run directly, the way slurmd runs them, without SLURM.

Fast companions of the real-SLURM test (tests/integration/test_slurm.py): the scripts get
the environment slurmd gives them (SLURM_JOB_ID, SLURM_JOB_USER, SLURM_JOB_UID), run as
root in their own process group, and that group is SIGKILLed when the prolog exits, as
slurmd does. The daemon must survive that, be reachable through the env file, and the
epilog must stop it. Soft errors must not fail the prolog.
"""

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

from conftest import wait_for
from ckptd.status import query_status

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROLOG = os.path.join(REPO, "deploy", "slurm", "prolog.sh")
EPILOG = os.path.join(REPO, "deploy", "slurm", "epilog.sh")
CKPTD_BIN = os.path.join(os.path.dirname(sys.executable), "ckptd")

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the prolog runs as root (chown, --chuid)"),
    pytest.mark.skipif(shutil.which("start-stop-daemon") is None,
                       reason="start-stop-daemon (Debian package dpkg) is missing"),
    pytest.mark.skipif(not os.access(CKPTD_BIN, os.X_OK),
                       reason=f"no ckptd executable beside {sys.executable} (pip install -e .)"),
]


class Node:
    """One fake node: a configuration file, a runtime base and a job id."""

    def __init__(self, tmp_path, **settings) -> None:
        # A short base: the socket path must fit in 107 bytes.
        self.base = tempfile.mkdtemp(prefix="ckptd-pe-", dir="/tmp")
        self.log_file = str(tmp_path / "prolog-epilog.log")
        self.job_id = str(800000 + os.getpid() % 100000)
        self.root = tmp_path / "ckpt"
        self.root.mkdir(exist_ok=True)
        values = {"CKPTD_BIN": CKPTD_BIN, "CKPTD_RUN_BASE": self.base,
                  "CKPTD_ROOTS": str(self.root), "CKPTD_POOL_SIZE": "32M", "CKPTD_WRITERS": "1",
                  "CKPTD_DRAIN_TIMEOUT": "10", "CKPTD_READY_TIMEOUT": "120",
                  "CKPTD_LOG_FILE": self.log_file, **settings}
        self.conf = tmp_path / "ckptd-slurm.conf"
        self.conf.write_text("".join(f'{k}="{v}"\n' for k, v in values.items()))
        self.dir = os.path.join(self.base, f"job-{self.job_id}")
        self.socket = os.path.join(self.dir, "ckptd.sock")

    def run(self, script: str, timeout: float = 180) -> subprocess.CompletedProcess:
        """Run ``script`` as slurmd would, then SIGKILL its process group."""
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CKPTD_CONF": str(self.conf),
               "SLURM_JOB_ID": self.job_id, "SLURM_JOB_USER": "root", "SLURM_JOB_UID": "0",
               "SLURM_SCRIPT_CONTEXT": "prolog_slurmd"}
        process = subprocess.Popen([script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                   text=True)
        # communicate() returns only when every holder of the pipes closed them: a daemon
        # that kept the prolog's stdout would make slurmd wait, and this time out.
        out, err = process.communicate(timeout=timeout)
        self.last_group = process.pid
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def log(self) -> str:
        try:
            with open(self.log_file) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def daemon_pid(self) -> int:
        with open(os.path.join(self.dir, "ckptd.pid")) as f:
            return int(f.read())

    def cleanup(self) -> None:
        if os.path.isdir(self.dir):
            self.run(EPILOG)
        shutil.rmtree(self.base, ignore_errors=True)


def running(pid: int) -> bool:
    state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                           text=True).stdout.strip()
    return bool(state) and not state.startswith("Z")


@pytest.fixture
def node(tmp_path):
    nodes = []

    def make(**settings) -> Node:
        nodes.append(Node(tmp_path, **settings))
        return nodes[-1]

    yield make
    for n in nodes:
        n.cleanup()


def test_prolog_starts_a_daemon_that_outlives_its_process_group_and_epilog_stops_it(node):
    n = node()
    result = n.run(PROLOG)
    assert result.returncode == 0, result.stderr + n.log()
    pid = n.daemon_pid()
    assert running(pid), "the daemon died with the prolog's process group"

    info = os.stat(n.dir)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == 0
    with open(os.path.join(n.dir, "env")) as f:
        assert f.read() == f"CKPTD_SOCKET={n.socket}\n"
    code, doc, why = query_status(n.socket, timeout=10)
    assert code == 0, why
    assert doc["pid"] == pid and doc["roots"] == [str(n.root)]
    assert os.getsid(pid) != n.last_group and os.getpgid(pid) != n.last_group, \
        "the daemon must leave the prolog's session and process group"
    assert f"ckptd pid {pid} ready for user root on {n.socket}" in n.log()
    with open(os.path.join(n.dir, "ckptd.log")) as f:
        assert f"ckptd ready socket={n.socket} pid={pid}" in f.read()

    result = n.run(EPILOG)
    assert result.returncode == 0, result.stderr
    assert not running(pid)
    assert not os.path.exists(n.dir)
    assert f"ckptd pid {pid} stopped" in n.log()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(f"ckptd-0-{pid}-")]


def test_prolog_with_a_missing_executable_logs_and_lets_the_job_run(node):
    n = node(CKPTD_BIN="/nonexistent/ckptd")
    result = n.run(PROLOG)
    assert result.returncode == 0
    assert "ckptd executable /nonexistent/ckptd not found" in n.log()
    assert "the job runs without a prolog-started ckptd" in n.log()


def test_prolog_when_the_daemon_cannot_start_exits_0_and_says_why(node):
    n = node(CKPTD_POOL_SIZE="lots")
    result = n.run(PROLOG)
    assert result.returncode == 0
    assert "ckptd exited before it was ready" in n.log()
    assert "is not a size" in n.log(), "the daemon's own reason should reach the log"


def test_strict_prolog_fails_when_the_daemon_cannot_start(node):
    n = node(CKPTD_POOL_SIZE="lots", CKPTD_PROLOG_STRICT="1")
    assert n.run(PROLOG).returncode == 1


def test_epilog_kills_a_daemon_that_ignores_sigterm(node, tmp_path):
    # A stand-in daemon that ignores SIGTERM (and has a child in its process group), but
    # writes its ready file like ckptd does.
    stubborn = tmp_path / "stubborn-ckptd"
    stubborn.write_text(
        "#!/bin/bash\n"
        "trap '' TERM\n"
        "sleep 1000 &\n"
        'dir=$(dirname "$3")\n'
        'echo "{\\"pid\\": $$}" > "$dir/ckptd.ready"\n'
        "while :; do sleep 0.1; done\n")
    stubborn.chmod(0o755)
    n = node(CKPTD_BIN=str(stubborn), CKPTD_DRAIN_TIMEOUT="1", CKPTD_KILL_AFTER="1")
    assert n.run(PROLOG).returncode == 0, n.log()
    pid = n.daemon_pid()
    child = int(subprocess.run(["pgrep", "-g", str(os.getpgid(pid)), "-x", "sleep"],
                               capture_output=True, text=True).stdout.split()[0])
    assert running(pid) and running(child)

    assert n.run(EPILOG, timeout=60).returncode == 0
    wait_for(lambda: not running(pid) and not running(child), 10, "the process group to die")
    assert "SIGKILL to its process group" in n.log()
    assert not os.path.exists(n.dir)


def test_epilog_without_a_daemon_is_quiet_and_succeeds(node):
    n = node()
    result = n.run(EPILOG)
    assert result.returncode == 0 and result.stderr == ""
