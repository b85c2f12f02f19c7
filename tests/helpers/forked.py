"""``run_forked(fn, *args, stderr=FILE)``: ``fn(*args)`` in a process forked from this test process's forkserver.

That process holds what a fresh command holds at its start (torch and polytrain imported by the forkserver,
nothing run) without a fresh interpreter's import of torch (seconds of CPU each). Tests use it where what they
check is a program's own behaviour (a reference script's result, an example's exit code, a limit applied from a
process's start), and keep ``python -m polytrain`` where they are about the process itself (signals, exit codes
of the command, stdout, nothing left behind). ``fn`` must be a module-level function (the forkserver imports it
by name)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable


def run_forked(fn: Callable[..., Any], *args: Any, stderr: Path | str | None = None, timeout: float = 300) -> int:
    """``fn(*args)`` in a forked process, its stderr into the file ``stderr`` (kept otherwise), its stdout kept;
    the process's exit code (``fn``'s return value as ``sys.exit`` takes it; killed after ``timeout`` seconds:
    -9)."""
    from polytrain.distributed.processes import start_context

    proc = start_context().Process(target=_call, args=(fn, args, stderr and str(stderr)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    return proc.exitcode


def _call(fn: Callable[..., Any], args: tuple[Any, ...], stderr: str | None) -> None:
    if stderr:
        os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    sys.exit(fn(*args))
