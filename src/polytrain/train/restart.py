"""Automatic restart after a failure: the launching process's loop around the run (``--max-restarts``).

``--max-restarts R``: when a worker dies (killed, crashed, or reported lost by the heartbeat), the launcher
has already stopped every worker; :func:`run` then starts the job again with ``--resume`` from the latest
good checkpoint in ``--checkpoint-dir``, up to R times. Each restart is logged with its cause (which rank,
how it died) and the checkpoint it resumes from, written to the metrics file as a ``restart`` record, and
listed in the summary (``restarts``, ``restart_causes``). An error that a restart cannot fix (a bad
setting, a diverged model, missing data) is raised at once, and so is a stop that a signal asked for. With
``--tolerate-worker-loss`` the death of an expendable worker is no failure (the launcher goes on without it,
:mod:`polytrain.distributed.supervisor`): nothing is raised, so nothing restarts.

Under ``torchrun`` the processes are torchrun's: its elastic agent restarts them (``torchrun
--max-restarts R``), and a restarted worker resumes from the latest checkpoint by itself
(``TORCHELASTIC_RESTART_COUNT`` > 0). polytrain's own ``--max-restarts`` must not ask for more restarts
than torchrun was given.

Under ``srun`` the restarts are Slurm's: a worker that sees a restartable failure asks Slurm to requeue the
job (``scontrol requeue``) while ``SLURM_RESTART_COUNT`` < ``--max-restarts``, and the requeued job resumes
from the latest checkpoint (:mod:`polytrain.train.requeue`). Under ``mpirun`` nothing restarts the ranks.

The workers' side (time-based checkpoints, the injected kill of the tests) is :mod:`polytrain.train.faults`.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

from torch import nn

from polytrain.config import RunConfig
from polytrain.data.base import DataBundle
from polytrain.distributed.cluster import adopt, on_failure, scheduler, slurm_restart_count
from polytrain.distributed.launch import under_torchrun
from polytrain.train.requeue import check_scheduler_restarts, requeue_after_failure
from polytrain.distributed.stop import StopSignal
from polytrain.environ import environment
from polytrain.errors import CommunicationError, ConfigError, WorkerError
from polytrain.log import get_logger
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.dirlock import hold
from polytrain.train.faults import ATTEMPT_ENV
from polytrain.train.on_failure import continuing
from polytrain.train.recovery import Recoveries, cost_summary, progress_space
from polytrain.train.snapshot import check_snapshots, promote, snapshot_space
from polytrain.train.run import layout_of, run as run_once

#: what a restart can help with: a process that died or was lost, a peer that did not answer
RESTARTABLE = (WorkerError, CommunicationError)


# -- the launching process: a loop around the run ------------------------------------------------------


def run(config: RunConfig, *, model: nn.Module | None = None,
        data: DataBundle | None = None) -> dict[str, Any] | None:
    """Train as ``config`` says, restarting after a failure up to ``--max-restarts`` times; return rank 0's
    summary with ``restarts`` and ``restart_causes`` (None in the other processes of a torchrun job)."""
    adopt()  # a task of srun or mpirun joins its job as a torchrun worker does (distributed/cluster.py)
    check_restarts(config)
    stop = StopSignal()  # a stop signal, from here to the end, stops the run in order (distributed/stop.py)
    with stop.handling(saves="after a checkpoint there" if config.checkpoint.checkpoint_dir else ""):
        if under_torchrun():
            return _under_torchrun(config, model, data, stop)
        return _attempts(config, model, data, stop)


def _attempts(config: RunConfig, model: Any, data: Any, stop: StopSignal) -> dict[str, Any] | None:
    """The first attempt, and one more after each restartable failure, up to ``--max-restarts``."""
    directory = config.checkpoint.checkpoint_dir
    # --on-failure continue replaces lost workers (any rank); a restart is for a job that failed all the same
    limit = config.restart.max_restarts if directory or not continuing(config) else 0
    # one run per checkpoint directory, for every attempt (train/dirlock.py); --snapshot-every: the snapshots'
    with hold(directory), snapshot_space(config) as snapshots, \
            progress_space(bool(limit)) as recoveries:  # place in memory (train/snapshot.py); what restarts cost
        before = _latest_mark(directory)  # a checkpoint already there when this run began is not this run's
        causes: list[dict[str, Any]] = []
        attempt = config
        started = time.monotonic()
        while True:
            number = len(causes)
            try:
                try:
                    with _attempt_env(number, recoveries):
                        summary = run_once(attempt, model=model, data=data, stop=stop)
                finally:  # (however it ended) what the restart that started it cost (train/recovery.py)
                    _recovered(recoveries.ended(number), config.log.metrics_file)
                break
            except RESTARTABLE as err:
                if len(causes) >= limit or stop.requested:  # a failure while stopping ends the run
                    if limit and not stop.requested:
                        get_logger().error(f"giving up after {limit} restart(s)")
                    raise
                promote(snapshots, directory, config.checkpoint.keep_checkpoints)  # a newer snapshot: the latest
                attempt, cause = _next_attempt(config, err, before, number + 1, time.monotonic() - started,
                                               recoveries)
                causes.append(cause)
    if summary is not None and limit:
        summary["restarts"] = len(causes)
        summary["restart_causes"] = causes
        summary["restart_cost_s"] = cost_summary(causes)  # median and spread per restart (train/recovery.py)
        summary["total_wall_s"] = round(time.monotonic() - started, 3)  # every attempt (wall_s: the last one's loop)
    return summary


def check_restarts(config: RunConfig) -> None:
    """One clear line for settings a restart cannot work with, before any process starts."""
    restart, directory = config.restart, config.checkpoint.checkpoint_dir
    if restart.max_restarts and not directory and not continuing(config):  # (continue: replacements need none)
        raise ConfigError(f"--max-restarts {restart.max_restarts} needs --checkpoint-dir DIR: a restart resumes "
                          "from the latest checkpoint there (add --checkpoint-every N or --checkpoint-every-seconds S "
                          "to bound the work lost)")
    if restart.checkpoint_every_seconds and not directory:
        raise ConfigError("--checkpoint-every-seconds needs --checkpoint-dir DIR (where the checkpoints go)")
    if config.checkpoint.checkpoint_background and not directory:
        raise ConfigError("--checkpoint-background needs --checkpoint-dir DIR (where the checkpoints go)")
    check_snapshots(config, elsewhere=scheduler() is not None or under_torchrun())
    if scheduler() is not None:
        check_scheduler_restarts(restart.max_restarts)
        return
    if under_torchrun():
        given = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restart.max_restarts > given:
            raise ConfigError(f"--max-restarts {restart.max_restarts}: under torchrun the restarts are torchrun's; "
                              f"give torchrun --max-restarts {restart.max_restarts} (it has {given})")
        return
    if restart.max_restarts and layout_of(config).processes == 1:
        raise ConfigError(f"--max-restarts: --strategy {config.train.strategy} with 1 process runs inside this "
                          "one, which cannot restart itself when it dies; run it under torchrun "
                          "--max-restarts R --nproc-per-node 1, or leave --max-restarts out")


def _under_torchrun(config: RunConfig, model: Any, data: Any, stop: StopSignal) -> dict[str, Any] | None:
    """A worker started by torchrun, srun or mpirun: resume after a restart (torchrun's, or Slurm's requeue)."""
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) or slurm_restart_count()
    if count and config.checkpoint.checkpoint_dir and not config.checkpoint.resume:
        if os.environ.get("RANK", "0") == "0":  # before the workers' logging is set up: say it once
            what = "Slurm requeue" if scheduler() == "slurm" else "torchrun restart"
            get_logger().warning(f"{what} {count}: resuming from the latest checkpoint in "
                                 f"{config.checkpoint.checkpoint_dir}")
        config = copy.deepcopy(config)
        config.checkpoint.resume = True
    rank0 = os.environ.get("RANK", "0") == "0"  # the global rank 0 holds the directory for the whole job
    requeue = (lambda _error: requeue_after_failure(config.restart.max_restarts)) \
        if scheduler() == "slurm" and config.restart.max_restarts else None
    on_failure(requeue)  # a rank lost: this one requeues the job before it exits (train/requeue.py)
    with hold(config.checkpoint.checkpoint_dir if rank0 else None):
        try:
            summary = run_once(config, model=model, data=data, stop=stop)
        except (*RESTARTABLE, RuntimeError, OSError):  # a peer lost, or a collective it broke (gloo's own error)
            if requeue is not None and not stop.requested:
                requeue(None)
            raise
        finally:
            on_failure(None)
    if summary is not None and count:
        summary["restarts"] = count  # the causes are in torchrun's own log
    return summary


def _next_attempt(config: RunConfig, err: Exception, before: tuple[str, int] | None, number: int,
                  elapsed: float, recoveries: Recoveries) -> tuple[RunConfig, dict[str, Any]]:
    """The config of restart ``number`` and the record of its cause."""
    directory = config.checkpoint.checkpoint_dir
    latest = _latest_mark(directory)
    # resume only from a checkpoint this run wrote (or, with --resume, from what it was asked to)
    resume = config.checkpoint.resume or (latest is not None and latest != before)
    cause = getattr(err, "cause", None) or str(err)
    source = f"the latest good checkpoint in {directory} ({latest[0]})" if resume and latest else "step 0"
    limit = config.restart.max_restarts
    get_logger().warning(f"restart {number} of {limit} after {elapsed:.1f} s: {cause}; all workers were stopped; "
                         f"starting again from {source}")
    record = {"restart": number, "cause": cause, "rank": getattr(err, "failed_rank", None),
              "resume_from": latest[0] if resume and latest else None, "after_s": round(elapsed, 3),
              "unix_time": time.time()}  # when every worker was stopped (the goodput benchmark reads it)
    recoveries.died(record, getattr(err, "failed_at", None) or time.time())  # the step reached (train/recovery.py)
    _append_metrics(config.log.metrics_file, {"event": "restart", **record})
    attempt = copy.deepcopy(config)
    attempt.checkpoint.resume = resume
    return attempt, record


def _latest_mark(directory: str | None) -> tuple[str, int] | None:
    """The latest checkpoint's file name and modification time (None: none)."""
    if not directory:
        return None
    latest = Checkpointer(directory).latest()
    if latest is None:
        return None
    try:
        return latest.name, latest.stat().st_mtime_ns
    except OSError:
        return None


def _append_metrics(path: str | None, record: dict[str, Any]) -> None:
    """The workers are all stopped when this runs: nobody else writes the file meanwhile."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _recovered(record: dict[str, Any] | None, metrics_file: str | None) -> None:
    """A restart's cost, known once the attempt it started has ended: logged, and a ``recovery`` record."""
    if record is None:
        return
    if record.get("first_step_s") is not None:
        back = "" if record["back_s"] is None else \
            f", back at step {record['reached_step']} after {record['back_s']:.1f} s ({record['redone_steps']} redone)"
        get_logger().info(f"restart {record['restart']}: first step {record['resumed_step'] + 1} done "
                          f"{record['first_step_s']:.1f} s after the failure{back}")
    _append_metrics(metrics_file, {"event": "recovery", **{k: record.get(k) for k in _RECOVERY_FIELDS}})


_RECOVERY_FIELDS = ("restart", "reached_step", "resumed_step", "redone_steps", "first_step_s", "back_s", "redo_s")


def _attempt_env(count: int, recoveries: Recoveries) -> contextlib.AbstractContextManager[None]:
    """``POLYTRAIN_RESTART_COUNT`` for the workers of one attempt (they inherit the launcher's environment), and
    the step the job had reached before the restart."""
    return environment({ATTEMPT_ENV: str(count), **recoveries.environ()})


