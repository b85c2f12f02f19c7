"""What each restart cost (``--max-restarts`` under polytrain's own launcher): the seconds from the death the
launching process saw to the next attempt's first completed step, and the steps redone until the job was back at
the step it had reached.

The launching process makes a small file in the machine's memory for the run (:data:`PROGRESS_ENV`; removed
when the command ends) and, for each restart, tells the next attempt the step the job had reached
(:data:`REACHED_ENV`). The trainers' main rank of each attempt keeps three fixed-width lines in it
(:class:`StepProgress`, one ``pwrite`` per step): the attempt's first completed step, its latest, and the moment
it was back at the step reached. The launching process reads them when a worker dies (the step reached) and when
the next attempt ends, however it ends (:class:`Recoveries`): each restart's record in the summary's
``restart_causes`` and a ``recovery`` record in the metrics file say

* ``reached_step``: the last step completed before the death; ``resumed_step``: where the next attempt began;
  ``redone_steps``: the difference;
* ``first_step_s``: the death to the next completed step (stopping the others, starting the workers, the
  rendezvous, the model and data, the checkpoint read, the first step);
* ``back_s``: the death until the job was back at the step it had reached (``first_step_s`` plus the steps
  redone): what the failure cost; ``redo_s`` the part spent redoing steps.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from polytrain.environ import environment

#: the run's progress file, for the workers of every attempt (set by the launching process)
PROGRESS_ENV = "POLYTRAIN_PROGRESS_FILE"
#: the step the job had reached when the previous attempt's worker died (set for the next attempt)
REACHED_ENV = "POLYTRAIN_REACHED_STEP"
_SHM = "/dev/shm"  # the machine's shared memory (a tmpfs); elsewhere the system's temporary directory
_WIDTH = 64  # bytes per line: "attempt step unix-time", padded
_FIRST, _LATEST, _BACK = 0, 1, 2


def memory_directory() -> str | None:
    """Where the launching process keeps a run's files in memory: ``/dev/shm`` where it can write, else None
    (the system's temporary directory)."""
    return _SHM if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK) else None


class StepProgress:
    """The trainers' main rank's side: the attempt's first and latest completed steps, and when it was back at the
    step reached before the restart, each written in place (a few microseconds a step)."""

    def __init__(self, path: str, attempt: int, reached: int | None):
        self.fd = os.open(path, os.O_WRONLY)
        self.attempt, self.reached = attempt, reached
        self.first = True

    @classmethod
    def from_env(cls, attempt: int, main: bool) -> "StepProgress | None":
        path = os.environ.get(PROGRESS_ENV)
        if not main or not path:
            return None
        reached = os.environ.get(REACHED_ENV)
        try:
            return cls(path, attempt, int(reached) if reached else None)
        except OSError:  # (the launching process removed it: the command is ending)
            return None

    def after_step(self, step: int) -> None:
        line = f"{self.attempt} {step} {time.time():.3f}".encode().ljust(_WIDTH - 1) + b"\n"
        if self.first:
            os.pwrite(self.fd, line, _FIRST * _WIDTH)
            self.first = False
        if self.reached is not None and step >= self.reached:
            os.pwrite(self.fd, line, _BACK * _WIDTH)
            self.reached = None
        os.pwrite(self.fd, line, _LATEST * _WIDTH)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


class Recoveries:
    """The launching process's side: what each restart cost, read from the progress file."""

    def __init__(self, path: Path | None):
        self.path = path
        self.pending: dict[str, Any] | None = None  # the latest restart's record, until its attempt ends
        self.died_at = 0.0

    def died(self, record: dict[str, Any], died_at: float) -> None:
        """A worker of the attempt ``record['restart'] - 1`` died at ``died_at`` (seconds since the epoch): note
        the step reached; the next attempt is told it (:meth:`environ`)."""
        latest = self._line(_LATEST, record["restart"] - 1)
        record["reached_step"] = latest[0] if latest else None
        self.pending, self.died_at = record, died_at

    def environ(self) -> dict[str, str]:
        """What the next attempt's workers inherit."""
        if self.pending is None or self.pending.get("reached_step") is None:
            return {REACHED_ENV: ""}
        return {REACHED_ENV: str(self.pending["reached_step"])}

    def ended(self, attempt: int) -> dict[str, Any] | None:
        """Attempt ``attempt`` ended (however): complete the record of the restart that started it (None: none)."""
        record, self.pending = self.pending, None
        if record is None:
            return None
        first, back = self._line(_FIRST, attempt), self._line(_BACK, attempt)
        reached = record.get("reached_step")
        record["resumed_step"] = first[0] - 1 if first else None
        record["redone_steps"] = reached - record["resumed_step"] if first and reached is not None else None
        record["first_step_s"] = round(first[1] - self.died_at, 3) if first else None
        record["back_s"] = round(back[1] - self.died_at, 3) if back else None
        record["redo_s"] = round(back[1] - first[1], 3) if first and back else None
        return record

    def _line(self, slot: int, attempt: int) -> tuple[int, float] | None:
        """(step, unix time) of ``slot`` written by ``attempt`` (None: none)."""
        if self.path is None:
            return None
        try:
            with open(self.path, "rb") as fh:
                fh.seek(slot * _WIDTH)
                fields = fh.read(_WIDTH).split()
            if len(fields) == 3 and int(fields[0]) == attempt:
                return int(fields[1]), float(fields[2])
        except (OSError, ValueError):
            pass
        return None


@contextlib.contextmanager
def progress_space(enabled: bool) -> Iterator[Recoveries]:
    """The run's progress file for the workers of every attempt (none unless ``enabled``); removed when the
    block ends, however it ends."""
    if not enabled:
        yield Recoveries(None)
        return
    fd, name = tempfile.mkstemp(prefix="polytrain-progress-", dir=memory_directory())
    try:
        os.write(fd, b" " * (_WIDTH * 3))
        os.close(fd)
        with environment({PROGRESS_ENV: name}):
            yield Recoveries(Path(name))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(name)


def cost_summary(causes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The median and the spread (min, max) over the restarts (their records) of ``back_s`` (the cost per
    failure), ``first_step_s`` and ``redone_steps``; None when no restart's cost is known."""
    out = {}
    for key in ("back_s", "first_step_s", "redone_steps"):
        values = [c[key] for c in causes if c.get(key) is not None]
        if values:
            out[key] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}
    return out or None
