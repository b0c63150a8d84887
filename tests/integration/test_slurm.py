"""The SLURM prolog and epilog against a real one-node SLURM (Debian's slurmctld and slurmd).

``deploy/slurm/one-node-cluster.sh up`` installs and starts the cluster with our prolog and
epilog; ``deploy/slurm/example-job.sbatch`` is submitted twice with ``sbatch``: the first
job trains and saves through the daemon its prolog started, the second resumes from the
first one's checkpoints. After each job the epilog must have stopped the daemon and
removed the job's directory.

Opt-in, because it installs packages and (re)starts SLURM daemons on the machine: run it
as root with ``python -m pytest -m slurm tests/integration/test_slurm.py`` (or set
``CKPTD_SLURM_TESTS=1``). CI (``CI=true``, as ``.ci/run`` is run there) opts in by itself. ``CKPTD_SLURM_TRAIN_SCRIPT`` overrides the training script
(default ``examples/train.py``).
"""

import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import wait_for

pytestmark = pytest.mark.slurm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_SCRIPT = os.path.join(REPO, "deploy", "slurm", "one-node-cluster.sh")
JOB_SCRIPT = os.path.join(REPO, "deploy", "slurm", "example-job.sbatch")
PROLOG_LOG = "/var/log/slurm/ckptd-prolog-epilog.log"
JOB_TIMEOUT = 600.0
STEPS = 10


def train_script() -> str:
    return os.environ.get("CKPTD_SLURM_TRAIN_SCRIPT") or os.path.join(REPO, "examples", "train.py")


def skip_reason(config) -> str | None:
    """Why this machine cannot (or should not) run the test, or None."""
    selected = "slurm" in (config.getoption("markexpr") or "") and \
        "not slurm" not in config.getoption("markexpr")
    opted_in = os.environ.get("CKPTD_SLURM_TESTS") == "1" or os.environ.get("CI") == "true"
    if not selected and not opted_in:
        return ("opt-in: installs and starts a real SLURM on this machine; run with -m slurm "
                "or CKPTD_SLURM_TESTS=1")
    if os.geteuid() != 0:
        return "needs root (installs packages, starts munged, slurmctld and slurmd)"
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        return "SLURM is not installed and apt-get is not available to install it"
    if not shutil.which("start-stop-daemon"):
        return "start-stop-daemon (Debian package dpkg) is missing"
    if not os.path.exists(train_script()):
        return f"the demo {train_script()} does not exist yet (set CKPTD_SLURM_TRAIN_SCRIPT)"
    return None


@pytest.fixture(scope="module")
def cluster(request):
    reason = skip_reason(request.config)
    if reason:
        pytest.skip(reason)
    started = time.monotonic()
    result = subprocess.run([CLUSTER_SCRIPT, "up"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        pytest.fail(f"one-node-cluster.sh up failed ({result.returncode}):\n{result.stderr}")
    print(f"cluster up in {time.monotonic() - started:.1f}s")
    yield
    # The cluster stays up for further runs; `one-node-cluster.sh down` stops it.


def job_state(job_id: str) -> str:
    result = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                            text=True, timeout=60)
    match = re.search(r"\bJobState=(\S+)", result.stdout)
    return match.group(1) if match else "UNKNOWN"


def submit(workdir: str, ckpt_dir: str, steps: int) -> str:
    env = {**os.environ, "TRAIN_SCRIPT": train_script(), "CKPT_DIR": ckpt_dir,
           "STEPS": str(steps), "NPROC_PER_NODE": "2"}
    env.pop("CKPTD_SOCKET", None)
    result = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}",
                             f"--output={workdir}/slurm-%j.out", JOB_SCRIPT],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def run_job(workdir: str, ckpt_dir: str, steps: int) -> tuple[str, str]:
    """Submit the example job, wait until it and its epilog finished; (job id, output)."""
    job_id = submit(workdir, ckpt_dir, steps)
    # COMPLETING lasts until the epilog has finished on the node.
    state = wait_for(lambda: (s := job_state(job_id)) not in
                     ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "UNKNOWN") and s,
                     JOB_TIMEOUT, f"job {job_id} to finish", interval=0.5)
    with open(os.path.join(workdir, f"slurm-{job_id}.out")) as f:
        output = f.read()
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{output}"
    return job_id, output


def daemon_pid(output: str) -> int:
    match = re.search(r"^ckptd serving pid=(\d+) .*done=(\d+) failed=0", output, re.M)
    assert match, f"no ckptd health line in the job output:\n{output}"
    return int(match.group(1))


def assert_stopped_and_cleaned(job_id: str, pid: int) -> None:
    def gone():
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                               text=True).stdout.strip()
        return state == "" or state.startswith("Z")

    wait_for(gone, 30, f"ckptd pid {pid} of job {job_id} to be stopped by the epilog")
    for base in ("/run/ckptd", "/tmp/ckptd-slurm"):
        assert not os.path.exists(f"{base}/job-{job_id}"), "the epilog left the job directory"
    with open(PROLOG_LOG) as f:
        log = f.read()
    assert re.search(rf"ckptd-prolog: job {job_id}: ckptd pid {pid} ready for user \S+ on "
                     rf"\S+/job-{job_id}/ckptd\.sock", log), log[-2000:]
    assert f"ckptd-epilog: job {job_id}: ckptd pid {pid} stopped" in log, log[-2000:]


def test_jobs_save_through_the_prolog_daemon_and_resume(cluster, tmp_path):
    workdir = str(tmp_path)
    ckpt_dir = os.path.join(workdir, "checkpoints")
    started = time.monotonic()

    first_id, first = run_job(workdir, ckpt_dir, STEPS)
    first_took = time.monotonic() - started
    assert re.search(r"ckptd: CKPTD_SOCKET=\S+/job-%s/ckptd\.sock \(directory \S+ 700\)"
                     % first_id, first), first
    first_pid = daemon_pid(first)
    saves = re.search(r"^ckptd serving pid=\d+ .*done=(\d+)", first.splitlines()[-1] if first else "")
    assert saves and int(saves.group(1)) > 0, f"the daemon saw no saves:\n{first}"
    assert re.search(r"\bsaved\b", first), first
    assert os.listdir(ckpt_dir), "no checkpoint was written"
    assert_stopped_and_cleaned(first_id, first_pid)

    second_id, second = run_job(workdir, ckpt_dir, 2 * STEPS)
    resumed = re.search(r"resumed from step (\d+)", second)
    assert resumed and int(resumed.group(1)) == STEPS, f"no resume from step {STEPS}:\n{second}"
    second_pid = daemon_pid(second)
    assert second_pid != first_pid
    assert_stopped_and_cleaned(second_id, second_pid)
    print(f"job {first_id}: {first_took:.1f}s; both jobs: {time.monotonic() - started:.1f}s")
