"""Workers started by a real Slurm (srun, sbatch, a requeue) and a real Open MPI (mpirun), one process per worker,
train the same model as polytrain's own launcher, bit for bit.

The Slurm cases run on a one-node cluster of this module's own (tests/helpers/slurm.py: munged, slurmctld and
slurmd from Debian's packages, two CPUs as two tasks), stopped with every process it started; the MPI case
runs Debian's Open MPI. Each is skipped, with the reason, where its packages are missing or cannot start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.slurm import SlurmCluster, Unavailable

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# the run every launcher makes: 2 workers of sync; checkpoints every 5 steps (what a requeued job resumes from)
RUN = ["--strategy", "sync", "--steps", "16", "--checkpoint-every", "5", "--heartbeat-timeout", "2",
       "--progress", "lines", "--log-every", "4", "--seed", "3", "--timeout", "60"]


def _env(cli_env: dict[str, str]) -> dict[str, str]:
    env = dict(cli_env, PATH=f"{BIN}{os.pathsep}{cli_env.get('PATH', '')}")
    for key in [k for k in env if k.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_"))] + ["MASTER_ADDR", "MASTER_PORT"]:
        env.pop(key, None)
    return env


def _same_model(path: Path, reference: dict[str, torch.Tensor]) -> None:
    model = torch.load(path, map_location="cpu", weights_only=True)
    assert model.keys() == reference.keys()
    different = [name for name in reference if not torch.equal(model[name], reference[name])]
    assert not different, f"parameters that differ from the local launcher's run: {different}"


@pytest.fixture(scope="module")
def env(module_cli_env):
    return _env(module_cli_env)


@pytest.fixture(scope="module")
def reference(env, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same run under polytrain's own launcher (2 spawned workers)."""
    work = tmp_path_factory.mktemp("local")
    proc = subprocess.run([str(BIN / "polytrain"), "train", *RUN, "--workers", "2", "--checkpoint-dir",
                           str(work / "ck"), "--save-model", str(work / "m.pt")], env=env, cwd=work,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return torch.load(work / "m.pt", map_location="cpu", weights_only=True)


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


def test_srun_tasks_train_the_local_launchers_model(slurm, env, reference, tmp_path):
    proc = slurm.run("srun", "-n", "2", "polytrain", "train", *RUN, "--checkpoint-dir", str(tmp_path / "ck"),
                     "--save-model", str(tmp_path / "m.pt"), env=env, cwd=tmp_path, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "strategy sync: 2 processes (2 on this machine" in proc.stdout  # one job of two srun tasks
    assert proc.stdout.count("done: 16 steps") == 1  # rank 0 alone reports
    _same_model(tmp_path / "m.pt", reference)


def test_sbatch_script_requeued_after_a_worker_dies_resumes_to_the_same_model(slurm, env, reference, tmp_path):
    """docs/clusters/slurm-one-node.sbatch, as a user submits it; rank 1 is killed after step 12: rank 0 sees it
    lost, requeues the job (--max-restarts), and the requeued job resumes from step 10's checkpoint."""
    kills = tmp_path / "kills"
    job_env = dict(env, POLYTRAIN_INJECT_KILL="rank=1,steps=12", POLYTRAIN_INJECT_KILL_LOG=str(kills))
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
    _same_model(tmp_path / "m.pt", reference)


def test_mpirun_ranks_train_the_local_launchers_model(env, reference, tmp_path):
    mpirun = shutil.which("mpirun")
    if mpirun is None or "Open MPI" not in subprocess.run([mpirun, "--version"], capture_output=True,
                                                          text=True).stdout:
        pytest.skip("no Open MPI here: apt-get install openmpi-bin (Debian), as .ci/run does")
    proc = subprocess.run([mpirun, "-np", "2", "--allow-run-as-root", "polytrain", "train", *RUN,
                           "--checkpoint-dir", str(tmp_path / "ck"), "--save-model", str(tmp_path / "m.pt")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "strategy sync: 2 processes (2 on this machine" in proc.stdout
    assert proc.stdout.count("done: 16 steps") == 1
    _same_model(tmp_path / "m.pt", reference)
