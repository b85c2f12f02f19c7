"""``--max-restarts`` under a scheduler: Slurm requeues the job, mpirun restarts nothing.

Under ``srun`` a failed task ends its job step; what restarts a Slurm job is Slurm itself, by requeueing it.
So with ``--max-restarts R`` a task that sees a restartable failure (a rank died or went silent) runs
``scontrol requeue $SLURM_JOB_ID`` while the job has been requeued fewer than R times
(``SLURM_RESTART_COUNT``); Slurm ends the job's processes and runs its batch script again, and the workers
of the new run resume from the latest checkpoint in ``--checkpoint-dir`` (:mod:`polytrain.train.restart`),
as after a torchrun restart. A job Slurm requeues by itself (node failure, preemption) resumes the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from polytrain.distributed.cluster import scheduler, slurm_restart_count
from polytrain.errors import ConfigError
from polytrain.log import get_logger

SCONTROL_TIMEOUT_S = 30.0


def check_scheduler_restarts(max_restarts: int) -> None:
    """One clear line, before training, for a ``--max-restarts`` the scheduler cannot honour."""
    if not max_restarts:
        return
    if scheduler() == "mpi":
        raise ConfigError(f"--max-restarts {max_restarts}: nothing restarts the ranks of an mpirun job; leave "
                          "--max-restarts out and run the same command again with --resume, or launch under "
                          "torchrun --max-restarts R, or under Slurm")
    if scheduler() != "slurm":
        return
    job = os.environ.get("SLURM_JOB_ID", "")
    scontrol = shutil.which("scontrol")
    if not job or scontrol is None:
        raise ConfigError(f"--max-restarts {max_restarts} under srun needs scontrol on PATH and SLURM_JOB_ID: a "
                          "restart is Slurm requeueing the job")
    shown = _scontrol(scontrol, "show", "job", "--oneliner", job)
    fields = dict(item.split("=", 1) for item in shown.split() if "=" in item)
    if fields.get("BatchFlag") != "1" or fields.get("Requeue") != "1":
        raise ConfigError(f"--max-restarts {max_restarts} under srun: Slurm requeues only a batch job that allows "
                          f"it, and job {job} is {'not a batch job' if fields.get('BatchFlag') != '1' else 'not requeueable'};"
                          " submit it with sbatch --requeue (see docs/clusters.md), or leave --max-restarts out")


def requeue_after_failure(max_restarts: int) -> bool:
    """After a restartable failure under Slurm: requeue the job if it has restarts left (True: asked)."""
    if scheduler() != "slurm" or not max_restarts:
        return False
    count = slurm_restart_count()
    job = os.environ.get("SLURM_JOB_ID", "")
    log = get_logger()
    if count >= max_restarts:
        log.error(f"giving up after {count} restart(s): Slurm job {job} was requeued {count} time(s), "
                  f"--max-restarts {max_restarts}")
        return False
    try:
        _scontrol(shutil.which("scontrol") or "scontrol", "requeue", job)
    except ConfigError as err:  # another task asked first (the job is requeueing), or Slurm refused
        log.warning(f"scontrol requeue {job}: {err}")
        return False
    log.warning(f"requeued Slurm job {job} (restart {count + 1} of {max_restarts}): it runs again and resumes "
                "from the latest checkpoint")
    return True


def _scontrol(scontrol: str, *args: str) -> str:
    try:
        done = subprocess.run([scontrol, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"scontrol {' '.join(args)} did not answer: {exc}") from None
    if done.returncode != 0:
        raise ConfigError(f"scontrol {' '.join(args)} failed: {(done.stderr or done.stdout).strip()}")
    return done.stdout
