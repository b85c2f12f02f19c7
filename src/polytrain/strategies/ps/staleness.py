"""The staleness bound (stale synchronous parallel, Ho et al. 2013) as plain data.

Clocks count each worker's steps from 0: worker ``w`` *starts* clock ``c`` when it pulls the parameters
for its step ``c``, and *finishes* it when a server has applied its gradient of step ``c``. ``finished[w]``
is the last clock worker ``w`` finished (-1 before its first).

With bound ``K``: no worker starts clock ``c + K + 1`` before every worker has finished clock ``c``; that is,
worker ``w`` may start clock ``c`` when ``min(finished) >= c - K - 1``. ``K = 0`` is bulk-synchronous (every
worker finishes step ``c - 1`` before anyone starts step ``c``); ``K = None`` never waits (fully asynchronous).

The *global clock* is ``min(finished) + 1``: how many steps every worker has finished. It is the version a
server hands out with the parameters, and the staleness of an applied gradient is the global clock just
before it is applied minus the global clock when its parameters were read. A worker that reads for clock ``c`` under
bound ``K`` sees a global clock >= ``c - K``, and until its own clock ``c`` is finished the global clock is
<= ``c``, so every recorded staleness is <= ``K``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class StalenessPolicy:
    bound: int | None = None  # None: fully asynchronous

    def __post_init__(self) -> None:
        if self.bound is not None and self.bound < 0:
            raise ConfigError(f"--staleness must be >= 0 (0 = bulk synchronous; leave it out for fully "
                              f"asynchronous), got {self.bound}")

    @property
    def synchronous(self) -> bool:
        return self.bound == 0

    def may_start(self, clock: int, finished: Sequence[int]) -> bool:
        """Whether a worker may start ``clock`` given every (still training) worker's finished clock."""
        if self.bound is None or not finished:
            return True
        return min(finished) >= clock - self.bound - 1

    def earliest_wait(self, clock: int) -> int:
        """The clock every worker must have finished before ``clock`` may start (-1: none)."""
        return -1 if self.bound is None else max(-1, clock - self.bound - 1)

    def describe(self) -> str:
        if self.bound is None:
            return "fully asynchronous (no staleness bound)"
        if self.bound == 0:
            return "bulk synchronous (staleness 0: every worker finishes step c before anyone starts c+1)"
        return (f"staleness bound {self.bound}: no worker starts step c+{self.bound + 1} before every worker "
                f"has finished step c")


def global_clock(finished: Sequence[int]) -> int:
    """Steps every worker has finished (``min(finished) + 1``); 0 with no workers listed."""
    return min(finished) + 1 if finished else 0
