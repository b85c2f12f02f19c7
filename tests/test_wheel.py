"""The package as a user installs it: ``python -m build`` makes a wheel and an sdist that carry the shipped data,
and the wheel installed into a fresh virtual environment trains and lists devices from outside the source tree.

The fresh environment reuses this one's torch and other dependencies through a ``.pth`` line (nothing is
downloaded); polytrain itself comes only from the wheel: the source tree is not on its path, and this
environment's editable install is not active there (a ``.pth`` line adds a directory, not its ``.pth`` files).
"""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("polytrain/data/digits.npz", "polytrain/data/devils_dictionary.txt.gz", "polytrain/data/text_tokenizer.json")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _run(args, cwd, timeout=180):
    done = subprocess.run(args, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} ended {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_wheel_installs_into_a_fresh_venv_and_trains_from_outside_the_source_tree(tmp_path):
    pytest.importorskip("build")
    source = tmp_path / "source"  # a copy: building writes egg-info next to the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = tmp_path / "dist"
    # --no-isolation: this environment's setuptools builds it (an isolated build would download one)
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)], tmp_path)
    (wheel,) = dist.glob("polytrain-*.whl")
    (sdist,) = dist.glob("polytrain-*.tar.gz")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        assert set(SHIPPED) <= names
        for name in SHIPPED:
            assert archive.read(name) == (ROOT / "src" / name).read_bytes()
        assert any(n.endswith(".dist-info/entry_points.txt") for n in names)
    with tarfile.open(sdist) as archive:
        names = {n.split("/", 1)[1] for n in archive.getnames() if "/" in n}
        assert {f"src/{name}" for name in SHIPPED} <= names and "pyproject.toml" in names

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        tmp_path).stdout.strip())
    # this environment's packages (torch, numpy, pip, ...) after the venv's own; its .pth files are not read
    (purelib / "reuse-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)], tmp_path)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    found = _run([str(python), "-c", "import importlib.util; print(importlib.util.find_spec('polytrain').origin)"],
                 elsewhere).stdout.strip()
    assert Path(found).is_relative_to(purelib), found  # the wheel's copy, not the source tree's
    for name in SHIPPED:
        assert (purelib / name).read_bytes() == (ROOT / "src" / name).read_bytes()
    devices = _run([str(venv / "bin" / "polytrain"), "devices"], elsewhere)
    assert "cpu" in devices.stdout
    trained = _run([str(venv / "bin" / "polytrain"), "train", "--steps", "5", "--progress", "lines"], elsewhere)
    assert "done: 5 steps" in trained.stdout + trained.stderr, trained.stdout + trained.stderr
