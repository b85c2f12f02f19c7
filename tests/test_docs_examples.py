"""Every ```python block of README.md and docs/*.md runs, so an example that stops working fails the suite.

Each block is written to a file in a fresh temporary directory and run as a script (``launch`` spawns
workers that import the script's functions by name, which ``python -c`` cannot offer) with this
checkout's sources on PYTHONPATH. A block that cannot run here is marked on the line right before it,
with the reason, and is skipped with that reason:

    <!-- example: skip, needs two CUDA devices -->
    <!-- example: skip, fragment: Net and loader stand for your own model and data -->

A block that imports an optional package (transformers, safetensors, ...: :data:`OPTIONAL`) is skipped, with
that reason, where the package is not installed; ``make test`` installs them all (requirements-dev.txt).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SRC

ROOT = Path(SRC).parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_MARK = re.compile(r"<!--\s*example:(.*?)-->")
_SKIP = re.compile(r"^\s*skip,\s*(\S.*?)\s*$")
#: the optional packages an example may import, and where they come from
OPTIONAL = {"transformers": "polytrain[interop]", "safetensors": "polytrain[safetensors]",
            "matplotlib": "polytrain[plot]", "mlflow": "polytrain[mlflow]", "wandb": "polytrain[wandb]",
            "tokenizers": "tokenizers", "datasets": "datasets", "peft": "peft"}


def _examples() -> list:
    out = []
    for page in PAGES:
        text = page.read_text()
        for block in _BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            before = text[: block.start()].rstrip("\n").rsplit("\n", 1)[-1]
            out.append(pytest.param(block.group(1), before, id=f"{page.relative_to(ROOT)}:{line}"))
    return out


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
def test_example_runs(code, line_before, tmp_path, cli_env):
    reason = _skip_reason(line_before) or _missing_packages(code)
    if reason:
        pytest.skip(reason)
    script = tmp_path / "example.py"
    script.write_text(code)
    env = dict(cli_env, PYTHONPATH=SRC)  # this checkout only, as a reader's fresh install would be
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"the example failed (exit {done.returncode}):\n{code}\n{done.stderr[-3000:]}"


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
