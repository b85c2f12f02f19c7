"""Stop signals answered from the command's first moment, while it imports and reads its arguments.

Importing the command (torch and every component) takes a second or more. A stop signal (SIGTERM, SIGINT,
SIGHUP, SIGUSR1) in that time ends the command with :data:`~polytrain.distributed.stop.EXIT_STOPPED` and one
line, as a stop before training began does later: nothing had started, nothing is lost. The entry point
(:mod:`polytrain.cli.entry`) installs these handlers; the command (:mod:`polytrain.cli.main`) puts the former
ones back with :func:`starting_done` once its arguments are read, unless it answers stop signals itself.
"""

from __future__ import annotations

import os
import signal
import sys

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")
_saved: dict[int, object] = {}  # the handlers before this module's, while they are installed


def _stopped_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write(f"polytrain: stopped by {signal.Signals(signum).name} while starting; nothing was started, "
                     "nothing is lost\n")
    sys.stderr.flush()
    from polytrain.distributed.prestart import stop_prestarted

    stop_prestarted()  # the workers' forkserver, if this command started it (distributed/prestart.py)
    os._exit(75)  # nothing else to clean up yet: only imports have run


def answer_while_starting() -> None:
    """Install the while-starting handlers, keeping the former ones for :func:`starting_done`."""
    for name in _SIGNALS:
        if hasattr(signal, name):
            sig = getattr(signal, name)
            _saved[sig] = signal.signal(sig, _stopped_while_starting)


def starting_done() -> None:
    """Put back the stop signals' handlers from before the command started (no-op when none is saved)."""
    while _saved:
        sig, old = _saved.popitem()
        signal.signal(sig, old)
