"""Automatic restart after a failure, checkpoints by elapsed time, and a deterministic kill for tests.

``--max-restarts R``: when a worker dies (killed, crashed, or reported lost by the heartbeat), the launcher
has already stopped every worker; :func:`run` then starts the job again with ``--resume`` from the latest
good checkpoint in ``--checkpoint-dir``, up to R times. Each restart is logged with its cause (which rank,
how it died) and the checkpoint it resumes from, written to the metrics file as a ``restart`` record, and
listed in the summary (``restarts``, ``restart_causes``). An error that a restart cannot fix (a bad
setting, a diverged model, missing data) is raised at once. With ``--tolerate-worker-loss`` the death of an
expendable worker is no failure (the launcher goes on without it, :mod:`polytrain.distributed.supervisor`):
nothing is raised, so nothing restarts; the same launch serves both, there is no second path to pass it to.

Under ``torchrun`` the processes are torchrun's: its elastic agent restarts them (``torchrun
--max-restarts R``), and a restarted worker resumes from the latest checkpoint by itself
(``TORCHELASTIC_RESTART_COUNT`` > 0). polytrain's own ``--max-restarts`` must not ask for more restarts
than torchrun was given.

``--checkpoint-every-seconds S``: checkpoint once S seconds have passed since the last checkpoint. The
trainers' rank 0 decides on its own clock at log points (``--log-every``), and the decision reaches every
trainer rank in one one-element all-reduce there, so they all checkpoint the same step; a step pays nothing.

``POLYTRAIN_INJECT_KILL="rank=R,steps=A+B+..."`` (for tests and the goodput benchmark, not a setting): global
rank R SIGKILLs itself after step A in the first attempt, after step B in the second, and so on (first
appending the time to the file ``POLYTRAIN_INJECT_KILL_LOG`` names, if set); ``,signal=SIGSTOP`` freezes it
instead (a machine that stopped answering: only the heartbeat notices).
"""

from __future__ import annotations

import copy
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from polytrain.distributed.launch import resolve_workers, under_torchrun
from polytrain.distributed.stop import StopSignal
from polytrain.errors import CommunicationError, ConfigError, WorkerError
from polytrain.log import get_logger
from polytrain.options import option, register_section

ATTEMPT_ENV = "POLYTRAIN_RESTART_COUNT"
KILL_ENV = "POLYTRAIN_INJECT_KILL"
KILL_LOG_ENV = "POLYTRAIN_INJECT_KILL_LOG"  # where a killed rank appends "attempt step unix-time" first
#: what a restart can help with: a process that died or was lost, a peer that did not answer
RESTARTABLE = (WorkerError, CommunicationError)

if TYPE_CHECKING:  # polytrain.config imports this module to register its section
    from torch import nn

    from polytrain.config import RunConfig
    from polytrain.data.base import DataBundle


@register_section("restart", "restarts after a failure", order=85)
@dataclass
class RestartConfig:
    max_restarts: int = option(0, "when a worker dies, stop all and start again from the latest checkpoint in "
                                  "--checkpoint-dir, up to R times (under torchrun: torchrun --max-restarts)",
                               minimum=0, metavar="R")
    checkpoint_every_seconds: float | None = option(None, "also checkpoint once S seconds have passed since the "
                                                          "last checkpoint (decided at log points)",
                                                    minimum=0.001, metavar="S")


# -- the launching process: a loop around the run ------------------------------------------------------


def run(config: RunConfig, *, model: nn.Module | None = None,
        data: DataBundle | None = None) -> dict[str, Any] | None:
    """Train as ``config`` says, restarting after a failure up to ``--max-restarts`` times; return rank 0's
    summary with ``restarts`` and ``restart_causes`` (None in the other processes of a torchrun job)."""
    from polytrain.train.dirlock import hold
    from polytrain.train.run import run as run_once

    check_restarts(config)
    stop = StopSignal()  # a stop signal, from here to the end, stops the run in order (distributed/stop.py)
    with stop.handling():
        if under_torchrun():
            return _under_torchrun(config, run_once, model, data, stop)
        return _attempts(config, run_once, model, data, stop, hold)


def _attempts(config: RunConfig, run_once: Any, model: Any, data: Any, stop: StopSignal,
              hold: Any) -> dict[str, Any] | None:
    """The first attempt, and one more after each restartable failure, up to ``--max-restarts``."""
    limit = config.restart.max_restarts
    directory = config.checkpoint.checkpoint_dir
    with hold(directory):  # one run per checkpoint directory, for every attempt (train/dirlock.py)
        before = _latest_mark(directory)  # a checkpoint already there when this run began is not this run's
        causes: list[dict[str, Any]] = []
        attempt = config
        started = time.monotonic()
        while True:
            try:
                with _attempt_env(len(causes)):
                    summary = run_once(attempt, model=model, data=data, stop=stop)
                break
            except RESTARTABLE as err:
                if len(causes) >= limit or stop.requested:  # a failure while stopping ends the run
                    if limit and not stop.requested:
                        get_logger().error(f"giving up after {limit} restart(s)")
                    raise
                attempt, cause = _next_attempt(config, err, before, len(causes) + 1, time.monotonic() - started)
                causes.append(cause)
    if summary is not None and limit:
        summary["restarts"] = len(causes)
        summary["restart_causes"] = causes
        summary["total_wall_s"] = round(time.monotonic() - started, 3)  # every attempt (wall_s: the last one's loop)
    return summary


def check_restarts(config: RunConfig) -> None:
    """One clear line for settings a restart cannot work with, before any process starts."""
    restart, directory = config.restart, config.checkpoint.checkpoint_dir
    if restart.max_restarts and not directory:
        raise ConfigError(f"--max-restarts {restart.max_restarts} needs --checkpoint-dir DIR: a restart resumes "
                          "from the latest checkpoint there (add --checkpoint-every N or --checkpoint-every-seconds S "
                          "to bound the work lost)")
    if restart.checkpoint_every_seconds and not directory:
        raise ConfigError("--checkpoint-every-seconds needs --checkpoint-dir DIR (where the checkpoints go)")
    if under_torchrun():
        given = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))
        if restart.max_restarts > given:
            raise ConfigError(f"--max-restarts {restart.max_restarts}: under torchrun the restarts are torchrun's; "
                              f"give torchrun --max-restarts {restart.max_restarts} (it has {given})")
        return
    if restart.max_restarts:
        from polytrain.strategies import get_strategy
        from polytrain.train.session import strategy_options

        strategy = get_strategy(config.train.strategy)
        workers = resolve_workers(config.launch.workers, config.device.device)
        if strategy.processes(workers, strategy_options(config, strategy)) == 1:
            raise ConfigError(f"--max-restarts: --strategy {config.train.strategy} with 1 process runs inside this "
                              "one, which cannot restart itself when it dies; run it under torchrun "
                              "--max-restarts R --nproc-per-node 1, or leave --max-restarts out")


def _under_torchrun(config: RunConfig, run_once: Any, model: Any, data: Any,
                    stop: StopSignal) -> dict[str, Any] | None:
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if count and config.checkpoint.checkpoint_dir and not config.checkpoint.resume:
        if os.environ.get("RANK", "0") == "0":  # before the workers' logging is set up: say it once
            get_logger().warning(f"torchrun restart {count}: resuming from the latest checkpoint in "
                                 f"{config.checkpoint.checkpoint_dir}")
        config = copy.deepcopy(config)
        config.checkpoint.resume = True
    from polytrain.train.dirlock import hold

    rank0 = os.environ.get("RANK", "0") == "0"  # the global rank 0 holds the directory for the whole job
    with hold(config.checkpoint.checkpoint_dir if rank0 else None):
        summary = run_once(config, model=model, data=data, stop=stop)
    if summary is not None and count:
        summary["restarts"] = count  # the causes are in torchrun's own log
    return summary


def _next_attempt(config: RunConfig, err: Exception, before: tuple[str, int] | None, number: int,
                  elapsed: float) -> tuple[RunConfig, dict[str, Any]]:
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
    _append_metrics(config.log.metrics_file, {"event": "restart", **record})
    attempt = copy.deepcopy(config)
    attempt.checkpoint.resume = resume
    return attempt, record


def _latest_mark(directory: str | None) -> tuple[str, int] | None:
    """The latest checkpoint's file name and modification time (None: none)."""
    if not directory:
        return None
    from polytrain.train.checkpoint import Checkpointer

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


class _attempt_env:
    """``POLYTRAIN_RESTART_COUNT`` for the workers of one attempt (they inherit the launcher's environment)."""

    def __init__(self, count: int):
        self.count = count

    def __enter__(self) -> None:
        self.saved = os.environ.get(ATTEMPT_ENV)
        os.environ[ATTEMPT_ENV] = str(self.count)

    def __exit__(self, *exc: Any) -> None:
        if self.saved is None:
            os.environ.pop(ATTEMPT_ENV, None)
        else:
            os.environ[ATTEMPT_ENV] = self.saved


def attempt_number() -> int:
    """Which attempt this process belongs to: 0 first, then 1 per restart (ours or torchrun's)."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


# -- in the workers: time-based checkpoints, and the injected kill -------------------------------------


class TimedCheckpoints:
    """Whether ``seconds`` have passed since the last checkpoint, on the deciding rank's clock, agreed by
    all trainer ranks (``agree(flag)`` returns the deciding rank's flag on every rank)."""

    def __init__(self, seconds: float | None, deciding: bool):
        self.seconds = seconds
        self.deciding = deciding
        self.last = time.monotonic()

    @property
    def enabled(self) -> bool:
        return bool(self.seconds)

    def due(self, agree: Any) -> bool:
        """Collective over the trainers when enabled: every trainer rank calls it at the same step."""
        if not self.enabled:
            return False
        mine = self.deciding and time.monotonic() - self.last >= self.seconds
        return bool(agree(mine))

    def reset(self) -> None:
        self.last = time.monotonic()


def agree_with_rank0(topology: Any) -> Any:
    """``agree(flag)`` over ``topology``: rank 0's flag everywhere, by one one-element all-reduce."""

    def agree(flag: bool) -> bool:
        value = torch.tensor([1.0 if flag and topology.is_main else 0.0], device=topology.device)
        return topology.all_reduce_sum(value).item() > 0

    return agree


@dataclass
class InjectedKill:
    """``POLYTRAIN_INJECT_KILL``: this rank sends itself ``signal`` (SIGKILL; SIGSTOP: a frozen machine)
    after ``step`` (None: never)."""

    step: int | None = None
    signal: str = "SIGKILL"

    @classmethod
    def from_env(cls, rank: int) -> "InjectedKill":
        spec = os.environ.get(KILL_ENV)
        if not spec:
            return cls()
        try:
            fields = dict(item.split("=", 1) for item in spec.split(","))
            steps = [int(s) for s in fields["steps"].split("+")]
            target = int(fields["rank"])
            sig = fields.get("signal", "SIGKILL")
            signal.Signals[sig]
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{KILL_ENV}={spec!r}: expected rank=R,steps=A+B+...[,signal=SIGSTOP] ({exc})") from None
        attempt = attempt_number()
        return cls(steps[attempt] if rank == target and attempt < len(steps) else None, sig)

    def after_step(self, step: int) -> None:
        if step == self.step:
            self._fire(step)

    def after_slice(self, step: int) -> None:
        """After a rank that takes work out of step order (an ``async`` helper) computed something of ``step``
        (counted as ``after_step``'s): it may never work on the named step itself, so the first at or past it."""
        if self.step is not None and step >= self.step:
            self.step = None  # once: a SIGSTOPped rank may go on after SIGCONT
            self._fire(step)

    def _fire(self, step: int) -> None:
        get_logger().warning(f"{KILL_ENV}: sending this process {self.signal} after step {step}")
        if os.environ.get(KILL_LOG_ENV):
            with open(os.environ[KILL_LOG_ENV], "a") as fh:
                fh.write(f"{attempt_number()} {step} {time.time()}\n")
        os.kill(os.getpid(), signal.Signals[self.signal])
