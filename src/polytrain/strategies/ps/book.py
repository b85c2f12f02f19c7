"""A parameter server's bookkeeping, without any communication: clocks, versions, deferred pulls, records.

The server loop feeds it what arrives (a pull, a push, a worker's "done") and does what it answers, so
every rule here (exactly-once application, the staleness bound, deferring a pull) is unit-tested without
processes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from polytrain.errors import CommunicationError
from polytrain.strategies.ps.staleness import StalenessPolicy, global_clock


@dataclass(frozen=True)
class UpdateRecord:
    """One applied gradient. ``staleness`` is in global clocks (bounded by K); ``missed`` counts the updates
    of other workers this server applied between the worker's read and this update."""

    worker: int
    clock: int
    read_version: int
    applied_version: int
    missed: int

    @property
    def staleness(self) -> int:
        return self.applied_version - self.read_version


class ServerBook:
    def __init__(self, workers: Sequence[int], policy: StalenessPolicy,
                 name: Callable[[int], str] = lambda r: f"worker rank {r}"):
        self.policy = policy
        self.name = name
        self.finished = {w: -1 for w in workers}
        self.done: set[int] = set()
        self.updates = 0
        self.records: list[UpdateRecord] = []
        self.duplicates: list[tuple[int, int]] = []
        self.pending: dict[int, int] = {}  # worker -> clock of its deferred pull
        self._read_updates = {w: 0 for w in workers}
        #: per worker, the staleness of its last applied gradient (told to it with its next pull's answer)
        self.last_staleness: dict[int, int] = {}

    # -- state ------------------------------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        return [w for w in self.finished if w not in self.done]

    def silent(self) -> list[int]:
        """Workers the server is waiting to hear from: still training and not waiting for a pull's answer
        (when every one of them waits, none is to blame and all are listed)."""
        return [w for w in self.active if w not in self.pending] or self.active

    @property
    def all_done(self) -> bool:
        return len(self.done) == len(self.finished)

    def version(self) -> int:
        """The global clock over the workers still training (over all of them once every one is done)."""
        active = self.active or list(self.finished)
        return global_clock([self.finished[w] for w in active])

    def caught_up(self, clock: int) -> bool:
        """Whether every worker still training has finished every step before ``clock`` (a read "at clock
        ``c``" sees exactly the updates of steps 0..c-1, whatever the staleness bound)."""
        return all(self.finished[w] >= clock - 1 for w in self.active)

    # -- events -----------------------------------------------------------------------------------------

    def start_at(self, clock: int) -> None:
        """Every worker's first step is ``clock`` (a resumed run): steps before it count as finished."""
        self.finished = {w: clock - 1 for w in self.finished}

    def pull(self, worker: int, clock: int) -> bool:
        """A worker asks for the parameters of ``clock``: True = answer now, False = deferred."""
        self.known(worker)
        if worker in self.pending:
            raise CommunicationError(f"{self.name(worker)} asked for step {clock} while its pull for step "
                                     f"{self.pending[worker]} was still waiting")
        if self.policy.may_start(clock, [self.finished[w] for w in self.active]):
            return True
        self.pending[worker] = clock
        return False

    def replied(self, worker: int) -> int:
        """The parameters went out to ``worker``; returns the version they carry."""
        self._read_updates[worker] = self.updates
        return self.version()

    def admit(self, worker: int, clock: int) -> bool:
        """Whether a pushed gradient is to be applied (False: a duplicate, recorded and ignored)."""
        self.known(worker)
        last = self.finished[worker]
        if clock <= last:
            self.duplicates.append((worker, clock))
            return False
        if clock != last + 1:
            raise CommunicationError(f"{self.name(worker)} pushed step {clock} after step {last}: "
                                     f"step(s) {last + 1}..{clock - 1} never arrived")
        return True

    def applied(self, worker: int, clock: int, read_version: int) -> UpdateRecord:
        """Record an applied gradient (after :meth:`admit` said yes) and advance the clocks."""
        missed = self.updates - self._read_updates[worker]
        record = UpdateRecord(worker, clock, read_version, self.version(), missed)  # the version it lands on
        self.updates += 1
        self.finished[worker] = clock
        self.records.append(record)
        self.last_staleness[worker] = record.staleness
        return record

    def finish(self, worker: int) -> None:
        self.known(worker)
        self.done.add(worker)
        self.pending.pop(worker, None)

    def ready(self) -> list[tuple[int, int]]:
        """Deferred pulls the policy now allows, removed from the waiting list: (worker, clock)."""
        finished = [self.finished[w] for w in self.active]
        out = [(w, c) for w, c in self.pending.items() if self.policy.may_start(c, finished)]
        for w, _ in out:
            del self.pending[w]
        return out

    def known(self, worker: int) -> None:
        if worker not in self.finished:
            raise CommunicationError(f"a message claims to come from rank {worker}, which is not a worker")
        if worker in self.done:
            raise CommunicationError(f"{self.name(worker)} sent a message after saying it was done")

    # -- summary ----------------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        staleness = [r.staleness for r in self.records]
        return {
            "updates": self.updates,
            "duplicates": list(self.duplicates),
            "max_staleness": max(staleness, default=0),
            "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_histogram": dict(sorted(Counter(staleness).items())),
            "max_missed": max((r.missed for r in self.records), default=0),
            "records": [(r.worker, r.clock, r.read_version, r.applied_version, r.missed) for r in self.records],
        }
