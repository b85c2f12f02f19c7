"""Processes that end with their parent: Linux's parent-death signal, and a process name for ps/top."""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sys

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
