"""Straggler injection (``--straggler``): make chosen workers slower, for experiments and tests.

A slow worker is what separates the strategies: ``sync`` waits for it every step, ``local-sgd``/``diloco``
only at meetings, ``async`` not at all. Real slowness (a busy core, thermal throttling, a noisy
neighbour) cannot be ordered on demand, so the trainer's loop makes it: after each step, a slowed worker
sleeps ``(FACTOR - 1)`` times the compute it just measured (the step's time less what it spent waiting for
other ranks), so it takes FACTOR times as long to do its own work whatever the model or machine.

* ``RANK:FACTOR`` slows trainer rank RANK on every step (repeatable: one spec per rank);
* ``random:P:FACTOR`` slows each worker on each step with probability P, from a stream seeded by
  ``--seed`` and the rank, so a run repeats its delays.

The seconds slept are reported per rank at every log point (``rank_straggler_s`` in the step records) and
in total in the end summary, so a test can check *who* was slowed without timing anything.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from polytrain.errors import ConfigError
from polytrain.options import option, register_section


@dataclass(frozen=True)
class Straggler:
    """One ``--straggler`` spec: ``rank`` None means every worker, each step with ``probability``."""

    rank: int | None
    factor: float
    probability: float = 1.0


def parse_straggler(spec: str) -> Straggler:
    """``RANK:FACTOR`` or ``random:P:FACTOR``; ValueError names what is wrong."""
    parts = spec.strip().split(":")
    try:
        if parts[0] == "random" and len(parts) == 3:
            found = Straggler(None, float(parts[2]), float(parts[1]))
        elif len(parts) == 2:
            found = Straggler(int(parts[0]), float(parts[1]))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"'{spec}': expected RANK:FACTOR (e.g. 1:2) or random:P:FACTOR (e.g. random:0.1:3)") \
            from None
    if found.rank is not None and found.rank < 0:
        raise ValueError(f"'{spec}': the rank must be >= 0")
    if not found.factor >= 1:  # also refuses nan
        raise ValueError(f"'{spec}': the factor is how many times slower, so >= 1 (got {found.factor:g})")
    if not 0 < found.probability <= 1:
        raise ValueError(f"'{spec}': the probability must be in (0, 1] (got {found.probability:g})")
    return found


def _check_specs(specs: list[str]) -> None:
    ranks = [s.rank for s in map(parse_straggler, specs) if s.rank is not None]
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"rank {twice[0]} is given twice; give one RANK:FACTOR per rank")


@register_section("straggler", "straggler injection (experiments)", order=88)
@dataclass
class StragglerConfig:
    straggler: list[str] = option([], "slow a worker down: RANK:FACTOR makes trainer rank RANK FACTOR times "
                                      "slower (it sleeps FACTOR-1 times its measured compute after each step), "
                                      "random:P:FACTOR does so to each worker on each step with probability P "
                                      "(seeded by --seed); repeatable", repeat=True, check=_check_specs,
                                  metavar="SPEC")


def check_stragglers(specs: list[str], workers: int) -> None:
    """Before launch: every named rank must be one of the ``workers`` trainer ranks."""
    for spec in specs:
        rank = parse_straggler(spec).rank
        if rank is not None and rank >= workers:
            raise ConfigError(f"--straggler {spec}: there is no worker {rank} with {workers} worker(s) "
                              f"(ranks 0-{workers - 1})")


class StragglerInjector:
    """Sleeps after this rank's steps as the specs say, and counts the seconds."""

    def __init__(self, specs: list[str], rank: int, seed: int):
        parsed = [parse_straggler(s) for s in specs]
        self.enabled = bool(parsed)
        self._always = sum(s.factor - 1 for s in parsed if s.rank == rank)
        self._random = [(s.probability, s.factor - 1) for s in parsed if s.rank is None]
        # a string seed is hashed the same way in every process and run (sha512), unlike hash() of a tuple
        self._draws = random.Random(f"polytrain-straggler:{seed}:{rank}")
        self._slept = 0.0
        self.total = 0.0

    def after_step(self, compute_s: float) -> float:
        """Sleep as this step's specs say, given the compute the step took; returns the seconds slept."""
        # every random spec draws every step, so the stream (and the run) repeats whatever was slept
        extra = self._always + sum(more for p, more in self._random if self._draws.random() < p)
        if extra <= 0 or compute_s <= 0:
            return 0.0
        started = time.perf_counter()
        time.sleep(extra * compute_s)
        slept = time.perf_counter() - started
        self._slept += slept
        self.total += slept
        return slept

    def take_metrics(self) -> dict[str, float]:
        """Seconds slept since the last call (only when stragglers are configured)."""
        if not self.enabled:
            return {}
        out, self._slept = {"straggler_s": round(self._slept, 4)}, 0.0
        return out

    def summary(self, trainers: Any) -> dict[str, Any]:
        """Every trainer's seconds slept over the run. Collective (when configured, on every rank alike)."""
        return {"rank_straggler_s": trainers.all_gather_object(round(self.total, 4))} if self.enabled else {}
