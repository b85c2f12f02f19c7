"""Children that answer signals as a user's shell would start them, whatever the pytest worker's own state.

A child inherits its parent's ignored signals and blocked-signal mask across fork and exec (only handlers are
reset), and Python does not install its Ctrl-C handler where SIGINT is ignored at start. A test that sends a
child SIGINT or SIGTERM must not depend on what ran before it in the same pytest worker: :func:`as_from_a_shell`
(a ``preexec_fn``) gives the child the default dispositions and an empty mask, and :func:`signal_state` reads
what the child has at the moment of sending, for the assertion's message."""

from __future__ import annotations

import signal

_STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def as_from_a_shell() -> None:
    """``preexec_fn``: default stop-signal dispositions, nothing blocked (runs in the child before exec)."""
    for sig in _STOP:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def signal_state(pid: int) -> str:
    """The process's ignored, blocked and caught signals (``/proc/PID/status``), or why they could not be read."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            return "; ".join(line.strip() for line in fh if line.startswith(("SigIgn", "SigBlk", "SigCgt")))
    except OSError as exc:
        return f"(no signal state: {exc})"
