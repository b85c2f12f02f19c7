"""Throughput over logging intervals, and the guard that stops a diverged run.

Neither waits for the device during a step: losses are summed as device tensors and read at log points,
and :class:`DivergenceGuard` keeps the first non-finite step on the device. On a GPU, reading a loss
every step (``.item()``) would stop the host from queueing the next step's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


_NONE = 2**62  # "no bad step yet": larger than any step number


@dataclass
class IntervalMeter:
    """Sums step times, examples and losses between two log points.

    ``busy_s`` excludes time spent waiting for other ranks (as reported by the strategy), so a rank's
    ``busy`` throughput shows how fast it is on its own: a straggler has the lowest. ``loss_sum`` may be a
    device tensor; it is read (once) by :attr:`mean_loss`.
    """

    steps: int = 0
    examples: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0
    loss_sum: Any = 0.0
    loss_steps: int = 0

    def add(self, examples: int, wall_s: float, wait_s: float, loss: torch.Tensor | float | None) -> None:
        self.steps += 1
        self.examples += examples
        self.wall_s += wall_s
        self.busy_s += max(wall_s - wait_s, 1e-9)
        if loss is not None:  # a rank that computes no loss (a pipeline's first stage) has none to add
            self.loss_sum = self.loss_sum + loss
            self.loss_steps += 1

    @property
    def sec_per_batch(self) -> float:
        return self.wall_s / max(self.steps, 1)

    @property
    def mean_examples(self) -> float:
        return self.examples / max(self.steps, 1)

    @property
    def mean_loss(self) -> float | None:
        return float(self.loss_sum) / self.loss_steps if self.loss_steps else None

    def steps_per_sec(self) -> float:
        """Steps per wall second: times the global batch, the job's examples/sec (slices may be unequal)."""
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    def busy_examples_per_sec(self) -> float:
        return self.examples / self.busy_s if self.busy_s > 0 else 0.0


class DivergenceGuard:
    """Remembers, on the device, the first step whose loss was NaN or infinite and that loss.

    :meth:`observe` queues a few tiny device ops and never waits; :meth:`first_bad` reads the result (a
    device sync), which the trainer does at log points and before anything is written, over all ranks.
    """

    def __init__(self, device: torch.device):
        self.step = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.loss = torch.zeros((), device=device)

    def observe(self, loss: torch.Tensor | None, step: int) -> None:
        if loss is None:
            return
        first = ~torch.isfinite(loss) & (self.step == _NONE)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, loss.to(self.loss.dtype), self.loss)

    def first_bad(self) -> tuple[int, float] | None:
        """(step, loss) of the first bad step seen here, or None."""
        step = int(self.step)
        return None if step == _NONE else (step, float(self.loss))


def first_divergence(found: list[tuple[int, float] | None]) -> tuple[int, float, int] | None:
    """(step, loss, rank) of the earliest bad step among the ranks' ``first_bad()`` (in rank order), if any."""
    bad = [(item[0], item[1], rank) for rank, item in enumerate(found) if item is not None]
    return min(bad) if bad else None
