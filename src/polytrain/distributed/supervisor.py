"""Watching spawned workers: collect their results, and when one fails, stop the rest and say why.

Each worker sends one message on its pipe (its result, or a description of its exception) and exits.
When any worker fails, the supervisor waits a moment for the other failures that follow from it (peers
of a dead rank see broken connections), picks the root cause, stops every remaining worker and raises.

Expendable ranks (``--tolerate-worker-loss``) are the exception: one that fails (an error, a signal, an exit
without a result) is logged as a warning and the others go on. Only while the job itself is sound: an
expendable rank's failure that comes after another rank's, or that reports the loss of a rank the job
cannot do without (its heartbeat's PeerLostError), is part of the job's failure.

Where every rank is expendable (``--on-failure continue``: rank 0 too), the job is done once one rank has
reported a result that is not None (the members' main rank reports the summary, the others None); the job
fails when every rank was lost before that.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Sequence

from polytrain import errors
from polytrain.log import get_logger

_SETTLE_S = 1.0  # how long to keep listening for related failures before choosing the root cause
_TERM_GRACE_S = 5.0
#: once every rank that is not expendable has finished, how long an expendable one still running may take (a
#: frozen one never ends by itself; its peers' heartbeats counted it lost before they could finish)
_STRAY_GRACE_S = 5.0
_COMM_HINTS = ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out",
               "socket", "peer", "store")


@dataclass
class Failure:
    rank: int
    kind: str  # "signal", "exit", "user", "exception", "stopped"
    message: str
    error_class: str = ""
    details: str = ""
    at: float = 0.0
    lost_rank: int | None = None  # a PeerLostError's: the rank it reports lost (None: the store)

    def ends_job(self, expendable: frozenset[int]) -> bool:
        """Whether this reports the loss of a rank (or of the store) the job cannot go on without."""
        return self.error_class in ("PeerLostError", "StateLost") and self.lost_rank not in expendable

    def priority(self) -> int:
        """Lower is more likely the root cause."""
        if self.error_class == "PeerLostError":  # a survivor reporting another rank's loss: never the cause
            return 5
        if self.kind == "signal":
            return 0
        if self.error_class == "CommunicationError":
            return 4  # a lost or silent peer: that peer's own failure (an exit, an error), if any, says more
        if self.kind == "user":
            return 1
        if self.kind == "exception" and not any(h in self.message.lower() for h in _COMM_HINTS):
            return 2
        return 6 if self.kind == "stopped" else 3


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """What a worker sends back about its exception (picklable, no live objects)."""
    user = isinstance(exc, errors.PolytrainError)
    return {
        "kind": "user" if user else "exception",
        "error_class": type(exc).__name__,
        "message": str(exc) if user else f"{type(exc).__name__}: {exc}",
        "details": "" if user else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        "lost_rank": getattr(exc, "rank", None) if isinstance(exc, errors.PeerLostError) else None,
    }


def _exit_failure(rank: int, exitcode: int) -> Failure:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else str(-exitcode)
        return Failure(rank, "signal", f"was killed by signal {name}", at=time.monotonic())
    return Failure(rank, "exit", f"exited with code {exitcode} without reporting an error (its output above says why)", at=time.monotonic())


def supervise(processes: list[Any], conns: list[Connection], names: Sequence[str] | None = None,
              expendable: Iterable[int] = frozenset(),
              wake: tuple[int, Callable[[], None]] | None = None,
              replace: Callable[[int], tuple[Any, Connection] | None] | None = None) -> list[Any]:
    """Wait for all workers; return their results in rank order, or stop them all and raise. ``names`` says
    what each rank is in the error (default "worker rank N"; e.g. "parameter server rank 2").

    ``expendable`` ranks (``--tolerate-worker-loss``) may fail without failing the job: such a loss is logged
    once as a warning, the others keep running, and its result is None. The job ends once every other rank
    has reported its result; an expendable rank still running then gets a few seconds more, then is stopped.

    ``wake`` = (descriptor, call): ``call()`` whenever the descriptor becomes readable (a signal arrived); what
    it raises ends the supervision (every worker is stopped) and propagates.

    ``replace(rank)`` (``--on-failure continue``) is called for each expendable rank lost: a new ``(process,
    pipe)`` for that rank, supervised in its place, or None (the job goes on without it).
    """
    watch = _Watch(processes, conns, names, frozenset(expendable), wake)
    watch.replace = replace
    try:
        watch.run()
    finally:
        stop_all(processes + watch.retired)
    return watch.outcome()


class _Watch:
    """One supervision: what each rank reported, how it ended, and when to stop waiting."""

    def __init__(self, processes: list[Any], conns: list[Connection], names: Sequence[str] | None,
                 expendable: frozenset[int], wake: tuple[int, Callable[[], None]] | None = None):
        self.processes, self.conns, self.names, self.expendable = processes, conns, names, expendable
        self.wake_fd, self.on_wake = wake if wake is not None else (None, None)
        self.results: dict[int, Any] = {}
        self.failures: list[Failure] = []
        self.lost: dict[int, str] = {}  # expendable ranks the job goes on without: what happened to them
        self.pending = {conn: rank for rank, conn in enumerate(conns)}
        self.alive = {proc.sentinel: rank for rank, proc in enumerate(processes)}
        self.first_failure_at: float | None = None
        self.needed_done_at: float | None = None  # when the last rank that is not expendable was done
        self.replace: Callable[[int], tuple[Any, Connection] | None] | None = None
        self.retired: list[Any] = []  # processes replaced by another in their rank
        self.losses: list[Failure] = []  # how the expendable ranks lost were: the cause if every rank is lost

    def run(self) -> None:
        while self.alive or self.pending:
            deadline = self._deadline()
            woken = [self.wake_fd] if self.wake_fd is not None else []
            ready = wait(list(self.pending) + list(self.alive) + woken,
                         timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self.wake_fd is not None and self.wake_fd in ready:
                self.on_wake()
                ready = [obj for obj in ready if obj != self.wake_fd]
                if not ready:
                    continue
            if not ready:
                break  # settle time over (the caller stops the rest), or the job is done without the strays
            for obj in ready:
                if obj in self.pending:
                    self._receive(obj)
                elif obj in self.alive:  # (not when its pipe was read at its exit, earlier in this batch)
                    rank = self.alive.pop(obj)
                    if self.processes[rank].sentinel == obj:  # (else a replaced process: its rank went on)
                        self._exited(rank)
            if self.failures and self.first_failure_at is None:
                self.first_failure_at = time.monotonic()
            if self.needed_done_at is None and self._needed_done():
                self.needed_done_at = time.monotonic()
        if not self.failures:
            for rank in self._running():  # expendable ones that did not finish with the others
                self._lose(rank, f"was still running {_STRAY_GRACE_S:g} s after every other rank had finished; "
                                 "stopping it")

    def outcome(self) -> list[Any]:
        """The results in rank order (None for a lost expendable rank), or the root cause of the failure."""
        silent = [rank for rank in range(len(self.processes)) if not self._settled(rank)]
        if not self.failures:  # an expendable rank gone without a word counts as lost, as at its exit
            for rank in [r for r in silent if r in self.expendable]:
                self._lose(rank, "exited without reporting a result")
            silent = [rank for rank in silent if rank not in self.expendable]
        if not self.failures and self._all_expendable() and not self._finished():  # every rank lost: a failure
            self.failures = self.losses or [Failure(rank, "stopped", what, at=time.monotonic())
                                            for rank, what in sorted(self.lost.items())]
        # stopped by stop_all, or gone without a word: the cause only when nothing else failed (a frozen rank
        # that its peers' heartbeats reported is named by them)
        self.failures += [Failure(rank, "stopped", "exited without reporting a result", at=time.monotonic())
                          for rank in silent]
        if self.failures:
            raise _root_cause(self.failures, len(self.processes), self.names, self.expendable)
        return [self.results.get(rank) for rank in range(len(self.processes))]

    # -- events ---------------------------------------------------------------------------------------

    def _receive(self, conn: Connection) -> None:
        rank = self.pending.pop(conn)
        try:
            status, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the process died before reporting; its sentinel says how
        if status == "ok":
            self.results[rank] = payload
        else:
            self._fail(Failure(rank, payload["kind"], payload["message"], payload["error_class"],
                               payload["details"], time.monotonic(), payload.get("lost_rank")))

    def _exited(self, rank: int) -> None:
        proc = self.processes[rank]
        proc.join()
        conn = self.conns[rank]
        if conn in self.pending and conn.poll(0):  # its last word (or end of file) first: it says more than
            self._receive(conn)                     # the exit code, and tells a result from none at all
        if self.processes[rank] is not proc:  # lost and replaced meanwhile (--on-failure continue)
            return
        if self._settled(rank):
            return
        if proc.exitcode != 0:
            self._fail(_exit_failure(rank, proc.exitcode))
        elif rank in self.expendable and not self.failures:
            self._lose(rank, "exited without reporting a result")
        # a rank that is not expendable and exited 0 without a result: judged at the end (outcome)

    def _fail(self, failure: Failure) -> None:
        """A rank failed: a loss the job goes on without, or a failure of the job."""
        if failure.rank in self.expendable and not self.failures and not failure.ends_job(self.expendable):
            verb = "" if failure.kind in ("signal", "exit", "stopped") else "failed: "
            self._lose(failure.rank, f"{verb}{failure.message}", failure.details)
            self.losses.append(failure)
        else:
            self.failures.append(failure)

    def _lose(self, rank: int, what: str, details: str = "") -> None:
        if rank in self.lost:
            return
        self.lost[rank] = what
        trace = f"\n{details.rstrip()}" if details else ""
        flag = "--on-failure continue" if self.replace is not None else "--tolerate-worker-loss"
        get_logger().warning(f"{_name(self.names, rank)} {what}; going on without it ({flag}){trace}")
        started = self.replace(rank) if self.replace is not None and self.needed_done_at is None else None
        if started is not None:  # a replacement in the same rank, admitted by the others at a step boundary
            proc, conn = started
            get_logger().warning(f"starting a replacement for {_name(self.names, rank)} (pid {proc.pid})")
            self.retired.append(self.processes[rank])
            self.processes[rank], self.conns[rank] = proc, conn
            self.pending[conn], self.alive[proc.sentinel] = rank, rank
            del self.lost[rank]

    # -- state ----------------------------------------------------------------------------------------

    def _settled(self, rank: int) -> bool:
        """Whether ``rank``'s end is known: a result, a failure or a loss."""
        return rank in self.results or rank in self.lost or any(f.rank == rank for f in self.failures)

    def _running(self) -> list[int]:
        return sorted(set(self.alive.values()) | set(self.pending.values()))

    def _needed_done(self) -> bool:
        """Every rank that is not expendable has ended (reported, and its process exited); where every rank is
        expendable, one has reported the job's result."""
        if self._all_expendable():
            return self._finished()
        return all(rank in self.expendable for rank in self._running())

    def _all_expendable(self) -> bool:
        return len(self.expendable) == len(self.processes)

    def _finished(self) -> bool:
        """A rank reported a result that is not None (where every rank is expendable: the job's summary)."""
        return any(result is not None for result in self.results.values())

    def _deadline(self) -> float | None:
        """When to stop waiting: after the settle time once a rank failed, or the strays' grace once done."""
        ends = []
        if self.first_failure_at is not None:
            ends.append(self.first_failure_at + _SETTLE_S)
        if self.needed_done_at is not None:
            ends.append(self.needed_done_at + _STRAY_GRACE_S)
        return min(ends) if ends else None


def send_report(conn: Connection, status: str, payload: Any) -> None:
    """Worker side: one message, plain-pickled (torch's shared-memory tensor passing would need the
    worker to stay alive until the launcher has mapped the memory)."""
    conn.send_bytes(pickle.dumps((status, payload)))


def stop_all(processes: list[Any]) -> None:
    """Kill every live worker (SIGKILL: a worker takes SIGTERM as a request to stop in order, which a failed
    job must not do), with the processes it started (a worker leads a process group of its own: its compiler
    subprocesses are in it), and reap them."""
    for proc in processes:
        if proc.is_alive():
            with contextlib.suppress(OSError, AttributeError, TypeError):
                if os.getpgid(proc.pid) == proc.pid:  # (its own group, not the launcher's)
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(OSError, AttributeError):
                proc.kill()
    for proc in processes:
        proc.join(_TERM_GRACE_S)


def _root_cause(failures: list[Failure], world_size: int, names: Sequence[str] | None = None,
                expendable: frozenset[int] = frozenset()) -> errors.PolytrainError:
    cause = min(failures, key=lambda f: (f.priority(), f.at))
    if cause.details:
        get_logger().error("rank %d failed:\n%s", cause.rank, cause.details.rstrip())
    if cause.kind == "user":
        cls = getattr(errors, cause.error_class, errors.PolytrainError)
        if not (isinstance(cls, type) and issubclass(cls, errors.PolytrainError)):
            cls = errors.PolytrainError
        err = Exception.__new__(cls)
        Exception.__init__(err, cause.message if world_size == 1 else f"[rank {cause.rank}] {cause.message}")
        err.failed_rank, err.cause = cause.rank, cause.message  # for a restart's log (train/restart.py)
        err.failed_at = _epoch(cause.at)
        return err
    others = sorted({f.rank for f in failures} - {cause.rank})
    tail = f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else ""
    verb = "" if cause.kind in ("signal", "exit", "stopped") else "failed: "
    name = _name(names, cause.rank)
    # a job that may lose some ranks says that this one was not among them (rank 0 under --on-failure continue)
    spare = (f" ({name} cannot be lost: only rank(s) {', '.join(map(str, sorted(expendable)))} may be)"
             if expendable and cause.rank not in expendable else "")
    err = errors.WorkerError(f"{name} {verb}{cause.message}{tail}; all workers were stopped{spare}")
    err.failed_rank, err.cause = cause.rank, f"{name} {verb}{cause.message}"  # for a restart's log (train/restart.py)
    err.failed_at = _epoch(cause.at)  # when the failure was seen (train/recovery.py: what a restart cost)
    return err


def _epoch(monotonic: float) -> float:
    """A ``time.monotonic()`` reading in seconds since the epoch."""
    return time.time() - (time.monotonic() - monotonic)


def _name(names: Sequence[str] | None, rank: int) -> str:
    return names[rank] if names else f"worker rank {rank}"
