"""The ``polytrain`` command's entry point: stop signals are answered from its first moment
(:mod:`polytrain.cli.starting`).

Importing the command (torch and every component) takes a second or more. A stop signal (SIGTERM, SIGINT,
SIGHUP, SIGUSR1) in that time ends the command with :data:`~polytrain.distributed.stop.EXIT_STOPPED` and one
line, as a stop before training began does later: nothing had started, nothing is lost. So it does while the
command reads its arguments, until a command that answers stop signals itself installs its own handlers where
it starts work (``polytrain train``: :mod:`polytrain.train.restart`); for any other command the signals' former
handlers are back before it starts (:func:`~polytrain.cli.starting.starting_done`).
"""

from __future__ import annotations

import os
import sys

from polytrain.cli.starting import answer_while_starting, starting_done
from polytrain.distributed.prestart import prestart


def main() -> int:
    from polytrain.train.startup import mark, process_started_at

    mark(process_started_at())  # the summary's startup_s counts from here (imports included)
    answer_while_starting()
    try:
        prestart(sys.argv[1:])  # the workers' forkserver imports torch while this process does (train)
        light = _light_command(sys.argv[1:])
        if light is None:
            from polytrain.cli.main import main as command
    except BaseException:
        starting_done()
        raise
    code = light() if light is not None else command()  # (each calls starting_done() once its arguments are read)
    exit_now(code)
    return code  # (not reached)


#: commands that need neither the settings nor the strategies: their module alone is imported (torch, not
#: torch.distributed's tensor, pipelining and compiler modules that registering every strategy imports)
LIGHT_COMMANDS = {"devices": "polytrain.cli.devices"}


def _light_command(argv: list[str]):
    """The command's function when ``argv`` names a light command (``polytrain devices ...``), else None."""
    if not argv or argv[0] not in LIGHT_COMMANDS:
        return None
    import importlib

    from polytrain.cli.main_light import run_light

    module = importlib.import_module(LIGHT_COMMANDS[argv[0]])
    return lambda: run_light(module, argv)


def exit_now(code: object) -> None:
    """End the command as soon as its work is done: its workers and helper processes have ended by now
    (cli/main.py), and the interpreter's finalization (collecting every module torch and polytrain imported)
    would keep the command alive seconds longer on a loaded machine (measured 6-9 s at a load of 20-35 on 2
    cores), which a scheduler counts as a step still running. Exit handlers (``atexit``) still run and the
    output is flushed. Under torchrun, srun or mpirun it also spares a worker an abort from a C++ thread of
    torch's (store, gloo) during finalization ("terminate called without an active exception", seen under srun
    with a task in a store wait at exit)."""
    import atexit
    import contextlib
    import logging

    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)


if __name__ == "__main__":
    sys.exit(main())
