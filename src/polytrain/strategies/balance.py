"""How a synchronous step's global batch is split over workers that do not run equally fast.

A synchronous step lasts as long as its slowest worker. On shared or mixed hardware the workers' speeds
drift apart for seconds at a time (a busy neighbour on one core, a slower GPU), and with equal slices every
other worker waits for the slow one. :class:`Balancer` gives each worker a slice of the global batch in
proportion to its measured speed, so that all of them finish at about the same time.

The update stays exactly the one of single-device training on the whole batch: worker ``r`` with ``n_r``
of ``B`` examples scales its mean loss by ``N * n_r / B`` (the generic step's
:func:`polytrain.strategies.step.loss_divisor`, which weighs any slice by its units), so the averaged
gradient is ``sum_r n_r / B * grad(mean loss of r)`` = the gradient of the mean loss over all ``B``.
Only the grouping of floating-point sums changes, as with any other split.

Everything here is plain data and arithmetic: every rank feeds the same measurements to its own copy and
gets the same split, without any further communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BalancePolicy:
    """How eagerly slices move. ``smoothing`` weighs the newest measurement in the running estimate of each
    worker's seconds per example; ``max_shift`` bounds a slice to ``(1 +- max_shift) x`` the equal slice, so
    one odd measurement cannot starve a worker; a new split is taken only when it is predicted to shorten
    the step by at least ``min_gain`` (each new batch shape costs a little: kernels are chosen per shape)."""

    smoothing: float = 0.5
    max_shift: float = 0.5
    min_gain: float = 0.01
    multiple: int = 1  # every slice a multiple of this (gradient accumulation needs K equal micro-batches)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 <= self.max_shift < 1:
            raise ValueError(f"max_shift must be in [0, 1), got {self.max_shift}")
        if self.multiple < 1:
            raise ValueError(f"multiple must be >= 1, got {self.multiple}")


def equal_split(total: int, workers: int) -> tuple[int, ...]:
    if total % workers:
        raise ValueError(f"{total} examples do not split equally over {workers} workers")
    return (total // workers,) * workers


def proportional_split(total: int, speeds: list[float], low: int, high: int, multiple: int = 1) -> tuple[int, ...]:
    """Integer slices summing to ``total``, each a multiple of ``multiple`` in ``[low, high]``, as close to
    proportional to ``speeds`` as those bounds allow (largest remainders get the leftover units)."""
    units, low_u, high_u = total // multiple, -(-low // multiple), high // multiple
    workers = len(speeds)
    if total % multiple or not workers * low_u <= units <= workers * high_u:
        raise ValueError(f"cannot split {total} into {workers} multiples of {multiple} within [{low}, {high}]")
    share = [units * s / sum(speeds) for s in speeds]
    sizes = [min(max(int(x), low_u), high_u) for x in share]
    while sum(sizes) != units:  # hand out (or take back) one unit at a time, fairest first
        grow = sum(sizes) < units
        open_ = [r for r in range(workers) if (sizes[r] < high_u if grow else sizes[r] > low_u)]
        pick = max(open_, key=lambda r: (share[r] - sizes[r]) if grow else (sizes[r] - share[r]))
        sizes[pick] += 1 if grow else -1
    return tuple(n * multiple for n in sizes)


@dataclass
class Balancer:
    """The split of each step's ``global_batch`` over ``workers``, updated from measured compute times.

    Call :meth:`update` once per step with every worker's ``(seconds, examples)`` of that step (the same
    list on every rank); :attr:`sizes` is then the split for the next step.
    """

    global_batch: int
    workers: int
    policy: BalancePolicy = field(default_factory=BalancePolicy)
    sizes: tuple[int, ...] = ()
    per_example: list[float] | None = None  # smoothed seconds per example, per worker
    changes: int = 0

    def __post_init__(self) -> None:
        if not self.sizes:
            self.sizes = equal_split(self.global_batch, self.workers)
        nominal, unit, shift = self.global_batch / self.workers, self.policy.multiple, self.policy.max_shift
        self.low = max(unit, -(-math.ceil(nominal * (1 - shift)) // unit) * unit)
        self.high = max(self.low, math.floor(nominal * (1 + shift)) // unit * unit)

    def update(self, measured: list[tuple[float, int]]) -> tuple[int, ...]:
        if len(measured) != self.workers:
            raise ValueError(f"expected {self.workers} measurements, got {len(measured)}")
        if sum(n for _, n in measured) != self.global_batch:
            raise ValueError(f"the workers' slices {[n for _, n in measured]} do not add up to the global "
                             f"batch {self.global_batch}: the ranks disagree about the split")
        latest = [seconds / max(n, 1) for seconds, n in measured]
        if self.per_example is None:
            self.per_example = latest
        else:
            a = self.policy.smoothing
            self.per_example = [a * new + (1 - a) * old for new, old in zip(latest, self.per_example)]
        if min(self.per_example) <= 0:
            return self.sizes
        proposal = proportional_split(self.global_batch, [1 / t for t in self.per_example], self.low, self.high,
                                      self.policy.multiple)
        if self.predicted_step(proposal) < self.predicted_step(self.sizes) * (1 - self.policy.min_gain):
            self.sizes = proposal
            self.changes += 1
        return self.sizes

    def predicted_step(self, sizes: tuple[int, ...]) -> float:
        """Seconds of the slowest worker's part under ``sizes``, by the current estimates."""
        assert self.per_example is not None
        return max(n * t for n, t in zip(sizes, self.per_example))

