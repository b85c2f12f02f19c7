"""Throughput over logging intervals, the steady rate of a run, and the guard that stops a diverged run.

None of them waits for the device during a step, and a step costs each a list append: losses are kept as
device tensors and folded (stacked, summed, checked) once per :data:`FOLD_EVERY` steps or when read, at log
points. On a GPU, reading a loss every step (``.item()``) would stop the host from queueing the next step's
kernels; on a CPU, a few tensor ops a step are tens of microseconds of a step that may take a millisecond.
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass

import torch


_NONE = 2**62  # "no bad step yet": larger than any step number
#: losses kept before they are folded into a sum (or checked): bounded memory whatever --log-every
FOLD_EVERY = 256


@dataclass
class IntervalMeter:
    """Step times and examples between two log points (:meth:`StepMeter.take_interval`).

    ``busy_s`` excludes time spent waiting for other ranks (as reported by the strategy), so a rank's
    ``busy`` throughput shows how fast it is on its own: a straggler has the lowest.
    """

    steps: int = 0
    examples: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0

    @property
    def sec_per_batch(self) -> float:
        return self.wall_s / max(self.steps, 1)

    @property
    def mean_examples(self) -> float:
        return self.examples / max(self.steps, 1)

    def steps_per_sec(self) -> float:
        """Steps per wall second: times the global batch, the job's examples/sec (slices may be unequal)."""
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    def busy_examples_per_sec(self) -> float:
        return self.examples / self.busy_s if self.busy_s > 0 else 0.0


class DivergenceGuard:
    """The steps' losses: their mean over each logging interval, and, on the device, the first step whose loss
    was NaN or infinite and that loss.

    :meth:`observe` keeps the loss (a list append). When read (:meth:`take_mean`, :meth:`first_bad`: at log
    points and before anything is written, over all ranks), the kept losses are stacked and summed (two ops),
    and the sum, read anyway for the mean, tells whether any was NaN or infinite: only then are they searched
    for the first bad one. Every :data:`FOLD_EVERY` steps between reads the kept losses are folded the same way
    with a few device ops that never wait, searched at once (nothing is read), so memory stays bounded.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.step = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.loss = torch.zeros((), device=device)
        self._steps: list[int] = []
        self._losses: list[torch.Tensor] = []
        self._sum: torch.Tensor | None = None  # the interval's losses folded so far
        self._count = 0
        self._searched = False  # whether a search ran (else self.step is still _NONE: nothing to read)

    def observe(self, loss: torch.Tensor | None, step: int, now: bool = False) -> None:
        """Keep ``loss``, the loss of ``step``; ``now``: fold and search what is kept at once (queued, not
        waited for: the per-operator log shows these ops in the step)."""
        if loss is None:  # a rank that computes no loss (a pipeline's first stage) has none to keep
            return
        self._steps.append(step)
        self._losses.append(loss)
        if now or len(self._losses) >= FOLD_EVERY:
            self._search(*self._fold())

    def _fold(self) -> tuple[torch.Tensor, list[int]]:
        """The kept losses stacked (and added to the interval's sum), with their steps; nothing kept after."""
        steps, losses = self._steps, self._losses
        self._steps, self._losses = [], []
        first = losses[0]
        if first.device != self.device or any(loss.dtype != first.dtype for loss in losses):
            losses = [loss.to(self.device, torch.float32) for loss in losses]
        stacked = torch.stack(losses)  # (the losses are detached 0-d tensors)
        total = stacked.sum()
        self._sum = total if self._sum is None else self._sum + total
        self._count += len(losses)
        return stacked, steps

    def _search(self, stacked: torch.Tensor, steps: list[int]) -> None:
        """Note the first NaN or infinite loss of ``stacked`` (of ``steps``) unless one was noted before."""
        self._searched = True
        bad = ~torch.isfinite(stacked)
        where = torch.argmax(bad.to(torch.uint8))  # the first bad one (0 when none: masked below)
        found = bad.any() & (self.step == _NONE)
        self.step = torch.where(found, torch.tensor(steps, device=self.device)[where], self.step)
        self.loss = torch.where(found, stacked[where].to(self.loss.dtype), self.loss)

    def _read(self) -> float | None:
        """The interval's loss sum (a sync), after folding what is kept; a sum that is not finite means a bad
        loss among them: the ones kept since the last fold are searched (earlier folds were)."""
        if self._losses:
            stacked, steps = self._fold()
            total = float(self._sum)
            if not math.isfinite(total):
                self._search(stacked, steps)
            return total
        return None if self._sum is None else float(self._sum)

    def take_mean(self) -> float | None:
        """The mean loss of the steps observed since the last call (None: none), and start the next interval."""
        total = self._read()
        if not self._count or total is None:
            return None
        mean = total / self._count
        self._sum, self._count = None, 0
        return mean

    def first_bad(self) -> tuple[int, float] | None:
        """(step, loss) of the first bad step seen here, or None."""
        if self._losses:
            self._read()
        if not self._searched:
            return None
        step = int(self.step)
        return None if step == _NONE else (step, float(self.loss))


def first_divergence(found: list[tuple[int, float] | None]) -> tuple[int, float, int] | None:
    """(step, loss, rank) of the earliest bad step among the ranks' ``first_bad()`` (in rank order), if any."""
    bad = [(item[0], item[1], rank) for rank, item in enumerate(found) if item is not None]
    return min(bad) if bad else None


#: a run's first steps, reported apart from its steady rate: lazy initialisation, the memory meter's measured
#: steps (train/memory.py), a compiled model's compilation
WARMUP_STEPS = 5
#: a log record's examples/sec covers the latest max(--log-every, RATE_WINDOW) steps after the warm-up
RATE_WINDOW = 50


class StepMeter:
    """Every step's own seconds (not the log points' work between steps) and examples: the current logging
    interval's (:meth:`take_interval`), the run's warm-up apart from its steady steps (the summary's rate), and
    the latest ``window`` steady steps (a log record's rate). A step costs one call; the sums are read at log
    points."""

    def __init__(self, window: int = RATE_WINDOW, warmup: int = WARMUP_STEPS):
        self._interval = IntervalMeter()
        self.warmup = warmup
        self.warmup_steps = 0
        self.warmup_s = 0.0
        self.steady_steps = 0
        self.steady_s = 0.0
        self.steady_examples = 0  # this rank's, and its seconds not waiting for others (its own speed)
        self.steady_busy_s = 0.0
        self.all_steps = 0
        self.all_s = 0.0
        self.all_examples = 0
        self.all_busy_s = 0.0
        self.latest: collections.deque[float] = collections.deque(maxlen=max(1, window))
        #: perf_counter() when the warm-up's last step ended (None: not yet)
        self.steady_since: float | None = None

    def add(self, examples: int, seconds: float, waited: float) -> None:
        """One step: ``examples`` of this rank's, ``seconds`` long, ``waited`` of them for other ranks."""
        interval = self._interval
        interval.steps += 1
        interval.examples += examples
        interval.wall_s += seconds
        busy = max(seconds - waited, 1e-9)
        interval.busy_s += busy
        self.all_steps += 1
        self.all_s += seconds
        self.all_examples += examples
        self.all_busy_s += busy
        if self.warmup_steps < self.warmup:
            self.warmup_steps += 1
            self.warmup_s += seconds
            if self.warmup_steps == self.warmup:
                self.steady_since = time.perf_counter()
            return
        self.steady_steps += 1
        self.steady_s += seconds
        self.steady_examples += examples
        self.steady_busy_s += busy
        self.latest.append(seconds)

    def take_interval(self) -> IntervalMeter:
        """The steps since the last call."""
        interval, self._interval = self._interval, IntervalMeter()
        return interval

    def window_steps_per_sec(self) -> float | None:
        """Steps per second over the latest steps after the warm-up (None: still warming up)."""
        seconds = sum(self.latest)
        return len(self.latest) / seconds if seconds > 0 else None

    def steady_steps_per_sec(self) -> float | None:
        """Steps per second over every step after the warm-up; over every step when the run was no longer
        than the warm-up (None: no step)."""
        if self.steady_s > 0:
            return self.steady_steps / self.steady_s
        return self.all_steps / self.all_s if self.all_s > 0 else None

    def steady_busy_examples_per_sec(self) -> float:
        """This rank's examples per second not spent waiting for other ranks, after the warm-up (over every step
        when the run was no longer than the warm-up; 0: no step)."""
        if self.steady_busy_s > 0:
            return self.steady_examples / self.steady_busy_s
        return self.all_examples / self.all_busy_s if self.all_busy_s > 0 else 0.0

    def warmup_steps_per_sec(self) -> float | None:
        return self.warmup_steps / self.warmup_s if self.warmup_s > 0 else None

    def seconds_left(self, steps_left: int, loop_started: float) -> float | None:
        """The wall seconds the remaining steps should take at the pace since the warm-up (log points' work,
        evaluation and checkpoints included), or since the loop began while still warming up."""
        now = time.perf_counter()
        if self.steady_since is not None and self.steady_steps:
            return steps_left * (now - self.steady_since) / self.steady_steps
        return steps_left * (now - loop_started) / self.all_steps if self.all_steps else None
