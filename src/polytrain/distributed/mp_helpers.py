"""multiprocessing's helper processes as this process knows them: its forkserver and its resource tracker.

The standard library has no public way to ask for their pids or to end them before the interpreter exits, so
this module is the one place that reads (and clears) multiprocessing's own bookkeeping: ``forkserver._forkserver``
(``_forkserver_pid``, ``_forkserver_alive_fd``) and ``resource_tracker._resource_tracker`` (``_pid``, ``_fd``),
the same in CPython 3.9 to 3.13. It imports nothing of torch's (the command's first moment uses it)."""

from __future__ import annotations

from typing import Any


def helper_table() -> list[tuple[Any, str, str, bool]]:
    """This process's multiprocessing helpers: (owner, its pid's attribute, its pipe's attribute, whether it is
    given time to end by itself: the resource tracker is, the forkserver holds nothing to clean up)."""
    from multiprocessing import forkserver, resource_tracker

    return [(getattr(forkserver, "_forkserver", None), "_forkserver_pid", "_forkserver_alive_fd", False),
            (getattr(resource_tracker, "_resource_tracker", None), "_pid", "_fd", True)]


def forkserver_pid() -> int | None:
    """The pid of the forkserver this process started; None when it started none (or it was ended)."""
    return getattr(helper_table()[0][0], "_forkserver_pid", None)


def tracker_pid() -> int | None:
    """The pid of the resource tracker this process started; None when it started none."""
    return getattr(helper_table()[1][0], "_pid", None)


def helper_processes() -> set[int]:
    """The pids of this process's running forkserver and resource tracker (none: empty)."""
    return {pid for owner, pid_attr, _, _ in helper_table() if (pid := getattr(owner, pid_attr, None)) is not None}


def release_inherited_forkserver() -> None:
    """In a process forked by a forkserver: close the inherited copy of the forkserver's "alive" pipe (so that
    the forkserver ends when its launcher does, not when the last worker does). A forkserver this process
    started itself is left alone."""
    import contextlib
    import os

    server, pid_attr, fd_attr, _ = helper_table()[0]
    fd = getattr(server, fd_attr, None)
    if fd is not None and getattr(server, pid_attr, None) is None:  # inherited, not our own server's
        with contextlib.suppress(OSError):
            os.close(fd)
        setattr(server, fd_attr, None)
