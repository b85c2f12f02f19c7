"""Watching spawned workers: collect their results, and when one fails, stop the rest and say why.

Each worker sends one message on its pipe (its result, or a description of its exception) and exits.
When any worker fails, the supervisor waits a moment for the other failures that follow from it (peers
of a dead rank see broken connections), picks the root cause, stops every remaining worker and raises.
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
from typing import Any, Sequence

from polytrain import errors
from polytrain.log import get_logger

_SETTLE_S = 1.0  # how long to keep listening for related failures before choosing the root cause
_TERM_GRACE_S = 5.0
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


def describe_exception(exc: BaseException) -> dict[str, str]:
    """What a worker sends back about its exception (picklable, no live objects)."""
    user = isinstance(exc, errors.PolytrainError)
    return {
        "kind": "user" if user else "exception",
        "error_class": type(exc).__name__,
        "message": str(exc) if user else f"{type(exc).__name__}: {exc}",
        "details": "" if user else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }


def _exit_failure(rank: int, exitcode: int) -> Failure:
    if exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.Signals._value2member_map_ else str(-exitcode)
        return Failure(rank, "signal", f"was killed by signal {name}", at=time.monotonic())
    return Failure(rank, "exit", f"exited with code {exitcode} without reporting an error (its output above says why)", at=time.monotonic())


def supervise(processes: list[Any], conns: list[Connection], names: Sequence[str] | None = None) -> list[Any]:
    """Wait for all workers; return their results in rank order, or stop them all and raise. ``names`` says
    what each rank is in the error (default "worker rank N"; e.g. "parameter server rank 2")."""
    results: dict[int, Any] = {}
    failures: list[Failure] = []
    pending = {conn: rank for rank, conn in enumerate(conns)}
    alive = {proc.sentinel: rank for rank, proc in enumerate(processes)}
    first_failure_at: float | None = None
    try:
        while alive or pending:
            timeout = None if first_failure_at is None else max(0.0, first_failure_at + _SETTLE_S - time.monotonic())
            ready = wait(list(pending) + list(alive), timeout=timeout)
            if not ready:
                break  # settle time over: stop the rest
            for obj in ready:
                if obj in pending:
                    _receive(obj, pending.pop(obj), results, failures)
                else:
                    rank = alive.pop(obj)
                    processes[rank].join()
                    code = processes[rank].exitcode
                    if code != 0 and rank not in results and not any(f.rank == rank for f in failures):
                        failures.append(_exit_failure(rank, code))
            if failures and first_failure_at is None:
                first_failure_at = time.monotonic()
    finally:
        stop_all(processes)
    silent = [rank for rank in range(len(processes))
              if rank not in results and not any(f.rank == rank for f in failures)]
    # stopped by stop_all, or gone without a word: the cause only when nothing else failed (a frozen rank
    # that its peers' heartbeats reported is named by them)
    failures += [Failure(rank, "stopped", "exited without reporting a result", at=time.monotonic())
                 for rank in silent]
    if failures:
        raise _root_cause(failures, len(processes), names)
    return [results.get(rank) for rank in range(len(processes))]


def send_report(conn: Connection, status: str, payload: Any) -> None:
    """Worker side: one message, plain-pickled (torch's shared-memory tensor passing would need the
    worker to stay alive until the launcher has mapped the memory)."""
    conn.send_bytes(pickle.dumps((status, payload)))


def _receive(conn: Connection, rank: int, results: dict[int, Any], failures: list[Failure]) -> None:
    try:
        status, payload = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the process died before reporting; its sentinel says how
    if status == "ok":
        results[rank] = payload
    else:
        failures.append(Failure(rank, payload["kind"], payload["message"], payload["error_class"],
                                payload["details"], time.monotonic()))


def stop_all(processes: list[Any]) -> None:
    """Terminate every live worker (SIGTERM, then SIGKILL after a grace period) and reap them."""
    for proc in processes:
        if proc.is_alive():
            proc.terminate()
            with contextlib.suppress(OSError):  # a stopped (SIGSTOP) worker acts on SIGTERM only once continued
                os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + _TERM_GRACE_S
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def _root_cause(failures: list[Failure], world_size: int, names: Sequence[str] | None = None) -> errors.PolytrainError:
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
        return err
    others = sorted({f.rank for f in failures} - {cause.rank})
    tail = f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else ""
    verb = "" if cause.kind in ("signal", "exit", "stopped") else "failed: "
    name = names[cause.rank] if names else f"worker rank {cause.rank}"
    err = errors.WorkerError(f"{name} {verb}{cause.message}{tail}; all workers were stopped")
    err.failed_rank, err.cause = cause.rank, f"{name} {verb}{cause.message}"  # for a restart's log (train/restart.py)
    return err
