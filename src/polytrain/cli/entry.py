"""The ``polytrain`` command's entry point: stop signals are answered from its first moment.

Importing the command (torch and every component) takes a second or more. A stop signal (SIGTERM, SIGINT,
SIGHUP, SIGUSR1) in that time ends the command with :data:`~polytrain.distributed.stop.EXIT_STOPPED` and one
line, as a stop before training began does later: nothing had started, nothing is lost. Once imported, the
command installs its own handlers where it starts work (``polytrain train``: :mod:`polytrain.train.restart`).
"""

from __future__ import annotations

import os
import signal
import sys

_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")


def _stopped_while_starting(signum: int, frame: object) -> None:
    sys.stderr.write(f"polytrain: stopped by {signal.Signals(signum).name} while starting; nothing was started, "
                     "nothing is lost\n")
    sys.stderr.flush()
    os._exit(75)  # nothing to clean up yet: only imports have run


def main() -> int:
    saved = {}
    for name in _SIGNALS:
        if hasattr(signal, name):
            sig = getattr(signal, name)
            saved[sig] = signal.signal(sig, _stopped_while_starting)
    try:
        from polytrain.cli.main import main as command
    finally:
        for sig, old in saved.items():
            signal.signal(sig, old)
    code = command()
    from polytrain.distributed.torchrun import under_torchrun

    if under_torchrun():  # one worker of torchrun, srun or mpirun (as python -m polytrain does: see __main__)
        import logging

        # a C++ thread of torch's (store, gloo) can abort a run that succeeded in the interpreter's finalization
        # ("terminate called without an active exception": seen under srun, a task in a store wait at exit)
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(code if isinstance(code, int) else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
