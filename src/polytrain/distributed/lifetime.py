"""Processes that end with their parent: Linux's parent-death signal, a process name for ps/top, and a check
before a write becomes visible that the launcher still lives."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys
from typing import Callable

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(name: str | None = None) -> None:
    """Linux: this process gets SIGKILL the moment its parent dies (``PR_SET_PDEATHSIG``), from the kernel, so
    it cannot go on even for a moment, whatever it is doing; ``name`` (15 bytes at most) is what ps and top
    show. Elsewhere: nothing."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if name:
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


def launcher_gone() -> bool:
    """Whether the process that started this one with multiprocessing (polytrain's launcher) has died: its end
    of the process pipe is closed. False where there is none (torchrun's workers, an in-process run)."""
    import multiprocessing
    import select

    parent = multiprocessing.parent_process()
    if parent is None or parent.sentinel is None:
        return False
    try:
        readable, _, _ = select.select([parent.sentinel], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def end_if_orphaned(cleanup: Callable[[], object] | None = None) -> None:
    """Called before a write becomes visible (a checkpoint's rename): if the launcher died, undo what
    ``cleanup`` undoes and end this process at once, so that nothing appears after the job's owner is gone.
    (The kernel ends it a few milliseconds later anyway; this closes that window.)"""
    if not launcher_gone():
        return
    if cleanup is not None:
        with contextlib.suppress(Exception):
            cleanup()
    import os

    os.kill(os.getpid(), signal.SIGKILL)
