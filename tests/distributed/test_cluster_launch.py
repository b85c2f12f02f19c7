"""Workers started by a real Slurm (srun, sbatch, a requeue) and a real Open MPI (mpirun), one process per worker,
train the same model as polytrain's own launcher, bit for bit.

The Slurm cases run on a one-node cluster of this module's own (tests/helpers/slurm.py: munged, slurmctld and
slurmd from Debian's packages, two CPUs as two tasks), stopped with every process it started; the MPI case
runs Debian's Open MPI. Each is skipped, with the reason, where its packages are missing or cannot start.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers.cluster_runs import RUN, assert_same_model
from tests.helpers.slurm import SlurmCluster, Unavailable

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slurm():
    cluster = SlurmCluster(cpus=2)
    try:
        cluster.start()
    except Unavailable as why:
        pytest.skip(f"no Slurm here: {why}")
    try:
        yield cluster
    finally:
        cluster.stop()


def test_srun_tasks_train_the_local_launchers_model(slurm, launcher_cli_env, cluster_reference, tmp_path):
    proc = slurm.run("srun", "-n", "2", "polytrain", "train", *RUN, "--checkpoint-dir", str(tmp_path / "ck"),
                     "--save-model", str(tmp_path / "m.pt"), env=launcher_cli_env, cwd=tmp_path, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "strategy sync: 2 processes (2 on this machine" in proc.stdout  # one job of two srun tasks
    assert proc.stdout.count("done: 16 steps") == 1  # rank 0 alone reports
    assert_same_model(tmp_path / "m.pt", cluster_reference)


def test_sbatch_script_requeued_after_a_worker_dies_resumes_to_the_same_model(slurm, launcher_cli_env, cluster_reference, tmp_path):
    """docs/clusters/slurm-one-node.sbatch, as a user submits it; rank 1 is killed after step 12: rank 0 sees it
    lost, requeues the job (--max-restarts), and the requeued job resumes from step 10's checkpoint."""
    kills = tmp_path / "kills"
    job_env = dict(launcher_cli_env, POLYTRAIN_INJECT_KILL="rank=1,steps=12", POLYTRAIN_INJECT_KILL_LOG=str(kills))
    submitted = slurm.run("sbatch", "--parsable", "--chdir", str(tmp_path), str(ROOT / "docs/clusters/slurm-one-node.sbatch"),
                          *RUN, "--save-model", str(tmp_path / "m.pt"), env=job_env)
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        state, reason = slurm.job_field(job, "JobState"), slurm.job_field(job, "Reason")
        if state == "PENDING" and reason == "BeginTime":  # Slurm holds a requeued job ~2 minutes: start it now
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.3)
    output = (tmp_path / f"polytrain-{job}.out").read_text()
    assert state == "COMPLETED", f"job {job} ended {state}:\n{output}"
    assert slurm.job_field(job, "Restarts") == "1", output
    assert kills.read_text().split()[:2] == ["0", "12"]  # the first run lost rank 1 after step 12
    assert f"requeued Slurm job {job} (restart 1 of 3)" in output
    assert "Slurm requeue 1: resuming from the latest checkpoint in runs/polytrain" in output
    assert output.count("done: 16 steps") == 1
    assert_same_model(tmp_path / "m.pt", cluster_reference)


def test_mpirun_ranks_train_the_local_launchers_model(launcher_cli_env, cluster_reference, tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None or "Open MPI" not in subprocess.run([mpirun, "--version"], capture_output=True,
                                                          text=True).stdout:
        pytest.skip("no Open MPI here: apt-get install openmpi-bin (Debian), as .ci/run does")
    proc = subprocess.run([mpirun, "-np", "2", "--allow-run-as-root", "polytrain", "train", *RUN,
                           "--checkpoint-dir", str(tmp_path / "ck"), "--save-model", str(tmp_path / "m.pt")],
                          env=launcher_cli_env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "strategy sync: 2 processes (2 on this machine" in proc.stdout
    assert proc.stdout.count("done: 16 steps") == 1
    assert_same_model(tmp_path / "m.pt", cluster_reference)


def test_max_restarts_under_srun_needs_a_requeueable_batch_job(slurm, monkeypatch):
    """Checked in the task before training: Slurm requeues only batch jobs (srun alone makes an interactive one)."""
    from polytrain.errors import ConfigError
    from polytrain.train.requeue import check_scheduler_restarts

    slurm.run("srun", "-n", "1", "true")  # an interactive job, as `srun polytrain train` outside sbatch makes
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    monkeypatch.setenv("POLYTRAIN_CLUSTER", "slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "999999")
    with pytest.raises(ConfigError, match=r"^scontrol show job --oneliner 999999 failed: .*Invalid job id"):
        check_scheduler_restarts(1)
    srun_jobs = [line.split()[0] for line in slurm.run("squeue", "-h", "-t", "all", "-o", "%i %j").stdout.splitlines()
                 if line.split()[1] == "true"]
    monkeypatch.setenv("SLURM_JOB_ID", srun_jobs[0])
    with pytest.raises(ConfigError, match=rf"^--max-restarts 1 under srun: Slurm requeues only a batch job that allows "
                                          rf"it, and job {srun_jobs[0]} is not a batch job; submit it with sbatch "
                                          r"--requeue \(see docs/clusters\.md\), or leave --max-restarts out$"):
        check_scheduler_restarts(1)
