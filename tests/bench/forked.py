"""A benchmark's plain reference script (``python -m polytrain.bench.<name>_reference ARGS``, the command line the
bench itself runs) as a process forked from the test process's forkserver: what the script does, without a fresh
interpreter's import of torch (seconds of CPU each). The bench's own runs of the command: tests/cli/test_bench.py,
and the quick suites."""

from __future__ import annotations

import importlib
import os
from pathlib import Path


def run_forked(command: list[str], stderr: Path, timeout: float = 300) -> int:
    """``command``'s module's ``main`` on its arguments in a forked process, its stderr into the file ``stderr``;
    its exit code."""
    from polytrain.distributed.processes import start_context

    assert command[1] == "-m" and command[2].startswith("polytrain.bench."), command
    proc = start_context().Process(target=_main, args=(command[2], command[3:], str(stderr)))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
    return proc.exitcode


def _main(module: str, argv: list[str], stderr: str) -> None:
    os.dup2(os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    importlib.import_module(module).main(argv)
