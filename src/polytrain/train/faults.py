"""The worker side of fault handling: checkpoints by elapsed time, and a deterministic kill for tests.

``--checkpoint-every-seconds S``: checkpoint once S seconds have passed since the last checkpoint. The
trainers' rank 0 decides on its own clock at log points (``--log-every``), and the decision reaches every
trainer rank in one one-element all-reduce there, so they all checkpoint the same step; a step pays nothing.

``POLYTRAIN_INJECT_KILL="rank=R,steps=A+B+..."`` (for tests and the goodput benchmark, not a setting): global
rank R SIGKILLs itself after step A in the first attempt, after step B in the second, and so on (first
appending the time to the file ``POLYTRAIN_INJECT_KILL_LOG`` names, if set); ``,signal=SIGSTOP`` freezes it
instead (a machine that stopped answering: only the heartbeat notices).

The launching process's side, the restart loop (``--max-restarts``), is :mod:`polytrain.train.restart`.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.distributed.cluster import slurm_restart_count
from polytrain.errors import ConfigError
from polytrain.log import EVERY_RANK, get_logger
from polytrain.options import option, register_section

ATTEMPT_ENV = "POLYTRAIN_RESTART_COUNT"
KILL_ENV = "POLYTRAIN_INJECT_KILL"
KILL_LOG_ENV = "POLYTRAIN_INJECT_KILL_LOG"  # where a killed rank appends "attempt step unix-time" first


@register_section("restart", "restarts after a failure", order=85)
@dataclass
class RestartConfig:
    max_restarts: int = option(0, "when a worker dies, stop all and start again from the latest checkpoint in "
                                  "--checkpoint-dir, up to R times (under torchrun: torchrun --max-restarts)",
                               minimum=0, metavar="R")
    checkpoint_every_seconds: float | None = option(None, "also checkpoint once S seconds have passed since the "
                                                          "last checkpoint (decided at log points)",
                                                    minimum=0.001, metavar="S")
    snapshot_every: int = option(0, "with --max-restarts: also write the state every K steps to this machine's "
                                    "memory (in the background), where a restart resumes from it instead of the "
                                    "disk's older checkpoint (0: none)", minimum=0, metavar="K")


def attempt_number() -> int:
    """Which attempt this process belongs to: 0 first, then 1 per restart (ours or torchrun's)."""
    return int(os.environ.get(ATTEMPT_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0) \
        or slurm_restart_count()  # a job Slurm requeued



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

    def mine(self) -> bool:
        """This rank's view, no collective: True only on the deciding rank, once the seconds have passed."""
        return self.enabled and self.deciding and time.monotonic() - self.last >= self.seconds

    def due(self, agree: Any) -> bool:
        """Collective over the trainers when enabled: every trainer rank calls it at the same step."""
        if not self.enabled:
            return False
        return bool(agree(self.mine()))

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
        get_logger().warning(f"{KILL_ENV}: sending this process {self.signal} after step {step}", extra=EVERY_RANK)
        if os.environ.get(KILL_LOG_ENV):
            with open(os.environ[KILL_LOG_ENV], "a") as fh:
                fh.write(f"{attempt_number()} {step} {time.time()}\n")
        os.kill(os.getpid(), signal.Signals[self.signal])
