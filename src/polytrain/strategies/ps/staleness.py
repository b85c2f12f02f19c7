"""The staleness bound (stale synchronous parallel, Ho et al. 2013) as plain data.

Every global step is cut into one slice per worker (N slices, each a *ticket*, handed out in order by
parameter server 0: :mod:`.book`). A step is *finished* once the servers have applied the gradients of all
its slices; the *version* of the servers' values is the number of steps finished from the start
(every step before it finished). Whichever worker computes a slice, it starts it by pulling the values.

With bound ``K``: no slice of step ``c + K + 1`` starts before step ``c`` has finished, i.e. a pull for step
``c`` is answered once the version is ``>= c - K``. ``K = 0`` is bulk-synchronous (step ``c - 1`` finished
before any slice of step ``c`` starts, so every slice of a step sees the same values, as ``sync``);
``K = None`` never waits (fully asynchronous). The staleness of an applied gradient is the version just
before it is applied minus the version of the values it was computed on: a pull for step ``c`` sees version
``>= c - K``, and until step ``c`` finishes the version is ``<= c``, so every recorded staleness is ``<= K``.

With a worker per slice (each worker computes slice ``w`` of every step, as the first protocol did) this
is the classic rule: no worker starts clock ``c + K + 1`` before every worker has finished clock ``c``.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    def may_start(self, step: int, version: int) -> bool:
        """Whether a slice of ``step`` may start when the first ``version`` steps have finished."""
        return self.bound is None or version >= step - self.bound

    def describe(self) -> str:
        if self.bound is None:
            return "fully asynchronous (no staleness bound)"
        if self.bound == 0:
            return "bulk synchronous (staleness 0: every slice of step c is applied before step c+1 starts)"
        return (f"staleness bound {self.bound}: no slice of step c+{self.bound + 1} starts before every slice "
                f"of step c is applied")
