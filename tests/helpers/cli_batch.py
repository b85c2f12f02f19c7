"""Many ``polytrain`` command lines that fail before anything starts, run in one fresh Python process: the
command's own ``main`` per line, its exit code, stdout and stderr as a separate ``python -m polytrain`` would
give them, without paying for torch's import once per line (about 3 s each on 2 cores). A command that starts no
worker at all (``checkpoint inspect``, ``checkpoint export``) runs in the test's own process: :func:`run_here`."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

_RUNNER = """
import contextlib, io, json, sys
from polytrain.cli.main import main
results = []
for argv in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    results.append([code, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_many(env: dict[str, str], lines: list[list[str]], timeout: float = 300) -> list[Result]:
    """Each of ``lines`` (argument lists after ``polytrain``) through the command's ``main``, in order."""
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(lines), env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return [Result(*r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def run_here(capsys, *argv: str) -> Result:
    """``polytrain ARGV`` through the command's ``main`` in this process, its output from ``capsys``."""
    from polytrain.cli.main import main

    capsys.readouterr()  # (what the test printed before is not the command's)
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return Result(code, out, err)


def fit_settings(flags: list[str]) -> dict[str, str]:
    """``--name value`` pairs of a command line as the keyword arguments of :func:`polytrain.fit` (a reference run
    in the test's own process, where what is tested is not the command's process)."""
    assert len(flags) % 2 == 0 and all(flag.startswith("--") for flag in flags[::2]), flags
    return {flag[2:].replace("-", "_"): value for flag, value in zip(flags[::2], flags[1::2])}
