"""When the command began, for the summary's ``startup_s``: the seconds from the command to the first step.

``polytrain`` (the command) marks its process's start, as the kernel recorded it (so the interpreter's own
start and every import count); :func:`polytrain.fit` marks the moment it is called. The mark travels to the
workers in the environment they inherit; the trainer's rank 0 reads it when its first step begins. Under
torchrun each worker process runs the command itself, so the time is counted from that worker's start (not
torchrun's). Importing this module imports nothing heavy: the command marks itself before it imports torch.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

from polytrain.environ import environment

ENV = "POLYTRAIN_STARTED_AT"


def process_started_at() -> float:
    """This process's start in seconds since the epoch (Linux: from /proc, 10 ms resolution; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])  # (boot time in /proc/stat is whole seconds: too coarse)
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.time()


def mark(at: float | None = None) -> None:
    """Count the start-up from ``at`` (seconds since the epoch; default now)."""
    os.environ[ENV] = repr(time.time() if at is None else at)


def seconds_since_mark() -> float | None:
    """Seconds since the mark (None: nothing marked, e.g. a Trainer made by hand)."""
    try:
        return max(0.0, time.time() - float(os.environ[ENV]))
    except (KeyError, ValueError):
        return None


@contextlib.contextmanager
def run_environment() -> Iterator[None]:
    """What a run puts in this process's environment for its workers (its start, where hang reports go) is the
    run's: a program that trains from inside (``polytrain.fit``, the command's ``main`` in a notebook or a test
    suite) has its own environment back afterwards, and a later child process inherits none of it."""
    from polytrain.distributed.hangs import RUN_DIR_ENV

    with environment(restore=(ENV, RUN_DIR_ENV)):
        yield
