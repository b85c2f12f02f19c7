"""Every ```python block of README.md and docs/*.md runs, so an example that stops working fails the suite; README.md
also runs top to bottom (with POLYTRAIN_README_TEST=1: it takes many minutes).

Each python block is written to a file in a fresh temporary directory and run as a script (a script's functions are
what ``launch``'s workers import by name) with this checkout's sources on the path, in a process forked from the
test process's forkserver (:func:`_run_as_script`). A block that cannot run here
is marked on the line right before it, with the reason, and is skipped with that reason:

    <!-- example: skip, needs two CUDA devices -->
    <!-- example: skip, fragment: Net and loader stand for your own model and data -->

README.md's ```bash and ```python blocks run in the order written, in one empty directory, on the shipped data, as
a reader would run them one after the other (:func:`test_the_readme_runs_top_to_bottom`); its blocks marked as
above are not run (a GPU, a cluster, root).

A block that imports an optional package (transformers, safetensors, ...: :data:`OPTIONAL`) is skipped, with
that reason, where the package is not installed; ``make test`` installs them all (requirements-dev.txt).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SRC
from tests.helpers.forked import run_forked

ROOT = Path(SRC).parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(python|bash)\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*example:(.*?)-->")
_SKIP = re.compile(r"^\s*skip,\s*(\S.*?)\s*$")
#: the optional packages an example may import, and where they come from
OPTIONAL = {"transformers": "polytrain[interop]", "safetensors": "polytrain[safetensors]",
            "matplotlib": "polytrain[plot]", "mlflow": "polytrain[mlflow]", "wandb": "polytrain[wandb]",
            "tokenizers": "tokenizers", "datasets": "datasets", "peft": "peft"}


def _blocks(page: Path) -> list[tuple[str, str, str, int]]:
    """(language, code, the line before it, line number) of each ```python and ```bash block of ``page``."""
    text = page.read_text()
    out = []
    for block in _BLOCK.finditer(text):
        line = text.count("\n", 0, block.start()) + 1
        before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((block.group(1), block.group(2), before, line))
    return out


def _examples() -> list:
    """The python blocks of README.md and the docs, each on its own (README.md's also run in order with its
    commands, below)."""
    return [pytest.param(code, before, id=f"{page.relative_to(ROOT)}:{line}")
            for page in PAGES for language, code, before, line in _blocks(page) if language == "python"]


def _skip_reason(line_before: str) -> str | None:
    """The reason given by a marker on the line before a block (None: no marker); a malformed marker fails."""
    mark = _MARK.search(line_before)
    if mark is None:
        return None
    reason = _SKIP.match(mark.group(1))
    assert reason, f"unknown example marker {mark.group(0)!r}; write <!-- example: skip, REASON -->"
    return reason.group(1)


def _missing_packages(code: str) -> str | None:
    """Why ``code`` cannot run here: the optional packages it imports that are not installed (None: all are)."""
    imported = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            imported.add(node.module.split(".")[0])
    missing = sorted(name for name in imported & OPTIONAL.keys() if importlib.util.find_spec(name) is None)
    if not missing:
        return None
    return f"needs {', '.join(missing)}, not installed (pip install {' '.join(OPTIONAL[n] for n in missing)})"


EXAMPLES = _examples()


@pytest.mark.parametrize("code, line_before", EXAMPLES)
def test_example_runs(code, line_before, tmp_path):
    reason = _skip_reason(line_before) or _missing_packages(code)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "example.py"
    script.write_text(code)
    exit_code, stderr = _run_as_script(script)
    assert exit_code == 0, f"the example failed (exit {exit_code}):\n{code}\n{stderr[-3000:]}"


def _run_as_script(script: Path, timeout: float = 300) -> tuple[int | None, str]:
    """``python SCRIPT`` in its directory, as a process forked from this process's forkserver (torch and polytrain
    imported once there, not once per example): ``__main__`` is the script (its functions importable by name, as
    ``launch``'s workers import them), its directory first on sys.path, the stop signals as a fresh interpreter
    has them. Its exit code and stderr."""
    stderr = script.with_suffix(".err")
    code = run_forked(_script_main, str(script), stderr=stderr, timeout=timeout)
    return code, stderr.read_text() if stderr.exists() else ""


def _script_main(script: str) -> None:
    import runpy
    import signal

    for number, handler in ((signal.SIGINT, signal.default_int_handler), (signal.SIGTERM, signal.SIG_DFL),
                            (signal.SIGHUP, signal.SIG_DFL), (signal.SIGUSR1, signal.SIG_DFL),
                            (signal.SIGUSR2, signal.SIG_DFL)):
        signal.signal(number, handler)  # (the forkserver ignores them: tests/cli/test_signals.py is about them)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os.chdir(os.path.dirname(script))
    sys.path.insert(0, os.path.dirname(script))
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


def test_the_readme_examples_are_found_and_run():
    """Guards the extraction itself: a changed fence or a stray marker would otherwise skip them silently."""
    readme = [p for p in EXAMPLES if p.id.startswith("README.md:")]
    assert len(readme) >= 2
    assert all(_skip_reason(p.values[1]) is None for p in readme)
    assert any("polytrain.launch(train" in p.values[0] for p in readme)  # the "your own loop" example


def test_markers_name_a_reason():
    assert _skip_reason("<!-- example: skip, needs a GPU -->") == "needs a GPU"
    assert _skip_reason("some prose") is None
    with pytest.raises(AssertionError, match="unknown example marker"):
        _skip_reason("<!-- example: skp, needs a GPU -->")
    with pytest.raises(AssertionError, match="unknown example marker"):
        _skip_reason("<!-- example: skip -->")


def test_an_example_that_imports_a_missing_optional_package_is_skipped_saying_which(monkeypatch):
    assert _missing_packages("import torch\nfrom polytrain import launch\n") is None
    monkeypatch.setitem(OPTIONAL, "polytrain_no_such_package", "polytrain-no-such-package")
    reason = _missing_packages("import os\nfrom polytrain_no_such_package.sub import x\n")
    assert reason == "needs polytrain_no_such_package, not installed (pip install polytrain-no-such-package)"


# -- README.md, top to bottom --------------------------------------------------------------------------------------

#: flags added to README commands that take minutes, so that each ends in seconds (the README says how long it takes
#: in full); a flag given again wins over the command's own. bench, compare and advise print what they would run:
#: tests/cli/test_bench.py, tests/cli/test_compare.py and tests/advise run them
SHORTER = {"train": ["--steps", "2"], "generate": ["--tokens", "5"], "bench": ["--plan"], "compare": ["--plan"],
           "advise": ["--plan"]}
#: README commands not run here, and why
NOT_RUN = {"sudo": "needs root and network namespaces: tests/compare/test_link.py runs polytrain compare --link"}
#: what a command needs that a minimal install lacks: it is skipped without it (and so is what reads its output)
NEEDS = {"transformers": ("import transformers", "hf:models/")}

# one process runs every command through the command's own main (torch imported once, the forkserver kept from
# one command to the next); a python block runs as a script. Each step's output follows a marker line.
_RUNNER = """
import contextlib, json, subprocess, sys
import polytrain.cli.main as cli
stop_helpers, cli.stop_helper_processes = cli.stop_helper_processes, lambda **_: None
codes = []
for i, (kind, argv, out) in enumerate(json.loads(sys.stdin.read())):
    for stream in (sys.stdout, sys.stderr):
        print(f"@@ step {i} @@", file=stream, flush=True)
    if kind == "polytrain":
        with open(out, "w") if out else contextlib.nullcontext() as fh, \\
                contextlib.redirect_stdout(fh) if out else contextlib.nullcontext():
            try:
                code = cli.main(argv)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    else:
        code = subprocess.run([sys.executable, *argv]).returncode
    sys.stdout.flush(); sys.stderr.flush()
    codes.append(code)
    if code:
        break
stop_helpers()
print(json.dumps(codes))
"""


def _commands(code: str) -> list[str]:
    """A bash block's command lines: continuations joined, comment lines and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


def _step(line: str) -> tuple[str, list[str], str | None] | str:
    """The runner's step for a README command line, or why it is not run."""
    words = shlex.split(line, comments=True)
    if words[0] in NOT_RUN:
        return NOT_RUN[words[0]]
    for package, signs in NEEDS.items():
        if any(sign in line for sign in signs) and importlib.util.find_spec(package) is None:
            return f"needs {package}"
    out = None
    if ">" in words:
        words, out = words[: words.index(">")], words[words.index(">") + 1]
    if words[:2] == ["python", "-c"]:
        return "python", words[1:], out
    assert words[0] == "polytrain", f"README.md: a command the test does not know how to run: {line}"
    argv = words[1:]
    if argv[0] in SHORTER and "--help" not in argv and "--print-config" not in argv:
        argv += ["--steps", "4"] if argv[0] == "train" and "--resume" in argv else SHORTER[argv[0]]
    return "polytrain", argv, out


def _readme_steps(tmp: Path) -> tuple[list[tuple[str, list[str], str | None]], list[str], list[str]]:
    """Every README block in order: the runner's steps, the README line of each, and what is not run and why."""
    steps, lines, skipped = [], [], []
    for number, (language, code, before, line) in enumerate(_blocks(README)):
        reason = _skip_reason(before)
        if reason:
            skipped.append(f"README.md:{line}: {reason}")
            continue
        if language == "python":
            script = tmp.parent / f"readme-{number}.py"
            script.write_text(code)
            steps.append(("python", [str(script)], None))
            lines.append(f"README.md:{line}: the python block")
            continue
        for command in _commands(code):
            step = _step(command)
            if isinstance(step, str):
                skipped.append(f"{command[:60]}: {step}")
            else:
                steps.append(step)
                lines.append(command)
    return steps, lines, skipped


def _outputs(text: str, count: int) -> list[str]:
    """Each step's part of the runner's output, split at its marker lines."""
    parts = re.split(r"^@@ step (\d+) @@$", text, flags=re.M)
    found = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    return [found.get(i, "") for i in range(count)]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POLYTRAIN_README_TEST"),
                    reason="runs every README command (tens of minutes on a loaded 2-core machine): "
                           "POLYTRAIN_README_TEST=1 runs it")
def test_the_readme_runs_top_to_bottom(tmp_path, cli_env):
    work = tmp_path / "work"
    work.mkdir()
    steps, lines, skipped = _readme_steps(work)
    env = dict(cli_env, PYTHONPATH=SRC)  # this checkout only, as a reader's fresh install would be
    done = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(steps), cwd=work, env=env,
                          capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, done.stderr[-3000:]
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    out, err = _outputs(done.stdout, len(steps)), _outputs(done.stderr, len(steps))
    for i, code in enumerate(codes):
        assert code == 0, f"README.md: `{lines[i]}` exited {code}:\n{out[i][-2000:]}\n{err[i][-3000:]}"
    assert len(codes) == len(steps)
    assert sum(kind == "python" and not argv[0].startswith("-") for kind, argv, _ in steps) == 2  # fit, launch
    by_line = dict(zip(lines, zip(out, err)))
    compiling = next(o for line, (o, e) in by_line.items() if "--compile" in line)
    assert "compiling: the first step compiles each unit" in compiling
    bench = next(o for line, (o, e) in by_line.items() if line.split()[:2] == ["polytrain", "bench"]
                 and "--suite" not in line)
    assert "21 runs (the default settings: about 7 min on 2 CPU cores)" in bench
    assert "lr_schedule" in (work / "run.toml").read_text() and (work / "runs" / "lm").is_dir()
    assert all("needs transformers" in s or s.startswith(("README.md:", "sudo")) for s in skipped), skipped
