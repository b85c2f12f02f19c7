"""A parameter server's bookkeeping, without any communication: tickets, clocks, versions, deferred pulls,
records.

Work is handed out as *tickets*: global step ``s`` is cut into one slice per worker, tickets ``s*N`` ..
``s*N + N - 1`` (N workers). Server 0 hands the next ticket to whichever worker asks (a fast worker takes
more slices than a slow one; no slice is computed twice or skipped); every server records which tickets it
has applied. A worker that computes a fixed slice (slice ``w`` of every step, the first protocol) pushes
without a ticket and its ticket is ``clock * N + w``. Each worker's pushes also carry its own *clock* (its
push count), so a retried push is recognised and applied once: exactly once per (worker, clock) and per
ticket.

The server loop feeds this book what arrives (a ticket request, a pull, a push, a worker's "done") and does
what it answers, so every rule here (exactly-once application, the staleness bound, deferring a pull) is
unit-tested without processes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from polytrain.errors import CommunicationError
from polytrain.strategies.ps.staleness import StalenessPolicy


@dataclass(frozen=True)
class UpdateRecord:
    """One applied gradient. ``staleness`` is in steps (versions; bounded by K); ``missed`` counts the
    updates of other workers this server applied between the worker's read and this update."""

    worker: int
    clock: int
    ticket: int
    read_version: int
    applied_version: int
    missed: int

    @property
    def staleness(self) -> int:
        return self.applied_version - self.read_version


class Tickets:
    """Which slices were handed out and which applied: the first ``handed`` tickets went out; every ticket
    below ``finished`` is applied, and ``above`` holds those applied past it. ``requeued`` holds tickets
    handed to a worker that was lost before it pushed them: they go out again first."""

    def __init__(self, per_step: int):
        self.per_step = per_step
        self.handed = self.finished = 0
        self.above: set[int] = set()
        self.requeued: list[int] = []  # sorted

    def start_at(self, step: int) -> None:
        self.handed = self.finished = step * self.per_step
        self.above.clear()
        self.requeued.clear()

    def take(self, step: int) -> int | None:
        """The next ticket if it belongs to a step ``<= step`` (None: every one of those is taken): a
        requeued one first, the earliest."""
        if self.requeued and self.requeued[0] // self.per_step <= step:
            return self.requeued.pop(0)
        if self.handed >= (step + 1) * self.per_step:
            return None
        self.handed += 1
        return self.handed - 1

    def requeue(self, tickets: Iterable[int]) -> list[int]:
        """Hand ``tickets`` out again (those not applied); returns them, sorted."""
        back = sorted(t for t in tickets if not self.applied(t) and t not in self.requeued)
        self.requeued = sorted(self.requeued + back)
        return back

    def applied(self, ticket: int) -> bool:
        return ticket < self.finished or ticket in self.above

    def apply(self, ticket: int) -> None:
        self.above.add(ticket)
        while self.finished in self.above:
            self.above.discard(self.finished)
            self.finished += 1

    @property
    def version(self) -> int:
        """Steps whose every slice is applied (from the start of training)."""
        return self.finished // self.per_step


class ServerBook:
    """``tolerant``: workers may be lost (``--tolerate-worker-loss``): what a lost worker held goes out again,
    and a push of a slice already applied (one a lost worker pushed to this server only) is a duplicate."""

    def __init__(self, workers: Sequence[int], policy: StalenessPolicy,
                 name: Callable[[int], str] = lambda r: f"worker rank {r}", tolerant: bool = False):
        self.policy = policy
        self.name = name
        self.tolerant = tolerant
        #: per worker, the tickets it was handed (server 0) or pulled for (the others) and has not pushed here
        self.holding: dict[int, set[int]] = {w: set() for w in workers}
        self.lost: list[int] = []  # workers lost, in the order the server learnt of it
        self.requeued_count = 0
        #: tickets this server never got because their worker was lost while pushing them (pushed to server 0,
        #: so not computed again): left out of this server's part of the parameters
        self.skipped: list[int] = []
        self.slot = {w: i for i, w in enumerate(workers)}  # a worker's fixed slice when it takes no tickets
        self.last_clock = {w: -1 for w in workers}
        self.tickets = Tickets(len(self.slot))
        self.done: set[int] = set()
        self.updates = 0
        self.records: list[UpdateRecord] = []
        self.duplicates: list[tuple[int, int]] = []
        self.pending: dict[int, int] = {}  # worker -> step of its deferred pull
        self._read_updates = {w: 0 for w in workers}
        #: per worker, the staleness of its last applied gradient (told to it with its next pull's answer)
        self.last_staleness: dict[int, int] = {}

    # -- state ------------------------------------------------------------------------------------------

    @property
    def active(self) -> list[int]:
        return [w for w in self.slot if w not in self.done]

    def silent(self) -> list[int]:
        """Workers the server is waiting to hear from: still training and not waiting for a pull's answer
        (when every one of them waits, none is to blame and all are listed)."""
        return [w for w in self.active if w not in self.pending] or self.active

    @property
    def all_done(self) -> bool:
        return len(self.done) == len(self.slot)

    def version(self) -> int:
        """Steps whose every slice is applied: the version of the values."""
        return self.tickets.version

    def caught_up(self, step: int) -> bool:
        """Whether every slice of the steps before ``step`` is applied (a read "at step ``s``" sees exactly
        the updates of steps 0..s-1, whatever the staleness bound and whoever computed them)."""
        return self.tickets.finished >= step * self.tickets.per_step

    # -- events -----------------------------------------------------------------------------------------

    def start_at(self, step: int) -> None:
        """Training starts at ``step`` (a resumed run): earlier steps count as applied, and every worker's
        first push is clock ``step``."""
        self.last_clock = {w: step - 1 for w in self.last_clock}
        self.tickets.start_at(step)

    def take_ticket(self, worker: int, step: int) -> int | None:
        """The next slice for ``worker``, which is at ``step`` (None: every slice up to ``step`` is taken)."""
        self.known(worker)
        ticket = self.tickets.take(step)
        if ticket is not None:
            self.holding[worker].add(ticket)
        return ticket

    def announce(self, worker: int, ticket: int) -> None:
        """``worker`` pulled from this server to compute slice ``ticket`` (a server other than the first one:
        what it may be owed if the worker is lost)."""
        self.holding[worker].add(ticket)

    def received(self, worker: int, ticket: int) -> None:
        """``worker``'s push of ``ticket`` arrived whole."""
        self.holding[worker].discard(ticket)

    def swap(self, worker: int, ticket: int) -> int | None:
        """A requeued slice for ``worker``, whose pull for slice ``ticket`` waits on the staleness bound, when
        the requeued one is earlier and may start now (``ticket`` goes back in the queue): the waiting workers
        may be the only ones left to compute it. None: no such slice."""
        queue = self.tickets.requeued
        if not queue or queue[0] >= ticket or not self.policy.may_start(queue[0] // self.tickets.per_step,
                                                                        self.version()):
            return None
        earlier = queue.pop(0)
        self.tickets.requeue([ticket])
        self.holding[worker].discard(ticket)
        self.holding[worker].add(earlier)
        self.pending[worker] = earlier // self.tickets.per_step
        return earlier

    def lose(self, worker: int) -> list[int]:
        """``worker`` is lost (first server: the tickets it held go out again, returned sorted). It counts as
        done; nothing it sends is taken from now on."""
        if worker in self.lost:
            return []
        self.lost.append(worker)
        back = self.tickets.requeue(self.holding[worker])
        self.requeued_count += len(back)
        self.holding[worker].clear()
        self.done.add(worker)
        self.pending.pop(worker, None)
        return back

    def abandon(self, worker: int, requeued: Iterable[int]) -> list[int]:
        """Another server than the first: ``worker`` is lost and the first server handed ``requeued`` out
        again. Slices the worker held here that are not among them were pushed to the first server (and
        will not be computed again): they count as applied here without an update. Returns them."""
        held = self.holding[worker] - set(requeued)
        self.lose(worker)
        skipped = sorted(t for t in held if not self.tickets.applied(t))
        for ticket in skipped:
            self.tickets.apply(ticket)
        self.skipped += skipped
        return skipped

    def pull(self, worker: int, step: int) -> bool:
        """A worker asks for the values to compute a slice of ``step``: True = answer now, False = deferred."""
        self.known(worker)
        if worker in self.pending:
            raise CommunicationError(f"{self.name(worker)} asked for step {step} while its pull for step "
                                     f"{self.pending[worker]} was still waiting")
        if self.policy.may_start(step, self.version()):
            return True
        self.pending[worker] = step
        return False

    def replied(self, worker: int) -> int:
        """The parameters went out to ``worker``; returns the version they carry."""
        self._read_updates[worker] = self.updates
        return self.version()

    def admit(self, worker: int, clock: int, ticket: int = -1) -> int | None:
        """The ticket of a pushed gradient, to be applied (the push is taken: a retry of it is a duplicate
        from now on, even while it waits to be applied in order); None: a duplicate (recorded and ignored)."""
        self.known(worker)
        last = self.last_clock[worker]
        if clock <= last:
            self.duplicates.append((worker, clock))
            return None
        if clock != last + 1:
            raise CommunicationError(f"{self.name(worker)} pushed step {clock} after step {last}: "
                                     f"step(s) {last + 1}..{clock - 1} never arrived")
        ticket = self._ticket(worker, clock, ticket)
        if self.tickets.applied(ticket) and self.tolerant:
            self.last_clock[worker] = clock  # a lost worker pushed it to this server only, before it was lost
            self.duplicates.append((worker, clock))
            return None
        if self.tickets.applied(ticket):
            raise CommunicationError(f"{self.name(worker)} pushed slice {ticket} (step "
                                     f"{ticket // self.tickets.per_step}), which is already applied")
        self.last_clock[worker] = clock
        return ticket

    def applied(self, worker: int, clock: int, read_version: int, ticket: int = -1) -> UpdateRecord:
        """Record an applied gradient (after :meth:`admit` gave its ticket) and advance the version."""
        ticket = self._ticket(worker, clock, ticket)
        missed = self.updates - self._read_updates[worker]
        record = UpdateRecord(worker, clock, ticket, read_version, self.version(), missed)  # the version it lands on
        self.updates += 1
        self.last_clock[worker] = max(self.last_clock[worker], clock)
        self.tickets.apply(ticket)
        self.records.append(record)
        self.last_staleness[worker] = record.staleness
        return record

    def _ticket(self, worker: int, clock: int, ticket: int) -> int:
        """A push's ticket: its own, or (-1) the worker's fixed slice of step ``clock``."""
        return ticket if ticket >= 0 else clock * self.tickets.per_step + self.slot[worker]

    def finish(self, worker: int) -> None:
        self.known(worker)
        self.done.add(worker)
        self.pending.pop(worker, None)

    def ready(self) -> list[tuple[int, int]]:
        """Deferred pulls the policy now allows, removed from the waiting list: (worker, step)."""
        out = [(w, s) for w, s in self.pending.items() if self.policy.may_start(s, self.version())]
        for w, _ in out:
            del self.pending[w]
        return out

    def known(self, worker: int) -> None:
        if worker not in self.slot:
            raise CommunicationError(f"a message claims to come from rank {worker}, which is not a worker")
        if worker in self.done:
            raise CommunicationError(f"{self.name(worker)} sent a message after saying it was done")

    # -- summary ----------------------------------------------------------------------------------------

    def rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """The records as rows ``[worker, clock, ticket, read version, applied version, missed]``."""
        return [(r.worker, r.clock, r.ticket, r.read_version, r.applied_version, r.missed) for r in self.records]

    def summary(self) -> dict[str, Any]:
        staleness = [r.staleness for r in self.records]
        return {
            "updates": self.updates,
            "duplicates": list(self.duplicates),
            "max_staleness": max(staleness, default=0),
            "mean_staleness": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_histogram": dict(sorted(Counter(staleness).items())),
            "max_missed": max((r.missed for r in self.records), default=0),
            "records": self.rows(),
            "workers_lost": list(self.lost),
            "slices_requeued": self.requeued_count,
            "slices_skipped": list(self.skipped),
        }
