"""A benchmark's plain reference script (``python -m polytrain.bench.<name>_reference ARGS``, the command line the
bench itself runs) as a process forked from the test process's forkserver: what the script does, without a fresh
interpreter's import of torch (seconds of CPU each). The bench's own runs of the command: tests/cli/test_bench.py,
and the quick suites."""

from __future__ import annotations

import importlib
from pathlib import Path

from tests.helpers.forked import run_forked


def run_script(command: list[str], stderr: Path, timeout: float = 300) -> int:
    """``command``'s module's ``main`` on its arguments in a forked process, its stderr into the file ``stderr``;
    its exit code."""
    assert command[1] == "-m" and command[2].startswith("polytrain.bench."), command
    return run_forked(_main, command[2], command[3:], stderr=stderr, timeout=timeout)


def _main(module: str, argv: list[str]) -> object:
    return importlib.import_module(module).main(argv)
