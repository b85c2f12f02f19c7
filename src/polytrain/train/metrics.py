"""Throughput over logging intervals, and the guard that stops a diverged run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from polytrain.errors import DivergedError


@dataclass
class IntervalMeter:
    """Sums step times and examples between two log points.

    ``busy_s`` excludes time spent waiting for other ranks (as reported by the strategy), so a rank's
    ``busy`` throughput shows how fast it is on its own: a straggler has the lowest.
    """

    steps: int = 0
    examples: int = 0
    wall_s: float = 0.0
    busy_s: float = 0.0
    loss_sum: float = 0.0

    def add(self, examples: int, wall_s: float, wait_s: float, loss: float) -> None:
        self.steps += 1
        self.examples += examples
        self.wall_s += wall_s
        self.busy_s += max(wall_s - wait_s, 1e-9)
        self.loss_sum += loss

    @property
    def sec_per_batch(self) -> float:
        return self.wall_s / max(self.steps, 1)

    @property
    def mean_examples(self) -> float:
        return self.examples / max(self.steps, 1)

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / max(self.steps, 1)

    def steps_per_sec(self) -> float:
        """Steps per wall second: times the global batch, the job's examples/sec (slices may be unequal)."""
        return self.steps / self.wall_s if self.wall_s > 0 else 0.0

    def busy_examples_per_sec(self) -> float:
        return self.examples / self.busy_s if self.busy_s > 0 else 0.0


def check_finite(loss: float, step: int) -> None:
    """Raise :class:`DivergedError` naming the step when the loss is NaN or infinite."""
    if not math.isfinite(loss):
        raise DivergedError(step, loss)
