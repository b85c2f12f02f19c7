"""Periodic, atomic checkpoints and resume.

A checkpoint is one ``torch.save`` file, ``step-00000100.pt``, holding the model, optimizer, step, data
position, every rank's RNG states and the resolved config. It is written to a temporary file in the same
directory, fsynced and renamed into place; only then does the ``latest`` pointer (itself replaced
atomically) move to it. A crash at any moment therefore leaves the previous checkpoint as the latest.
Files load with ``torch.load(..., weights_only=True)``: nothing in them needs pickle's arbitrary code.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polytrain.errors import ConfigError
from polytrain.options import option, register_section

FORMAT = "polytrain.checkpoint/1"
_NAME = re.compile(r"^step-(\d{8,})\.pt$")
LATEST = "latest"


@register_section("checkpoint", "checkpoints", order=80)
@dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = option(None, "directory for periodic checkpoints", metavar="DIR")
    checkpoint_every: int = option(0, "checkpoint every N steps (0: only at the end)", minimum=0, metavar="N")
    keep_checkpoints: int = option(3, "how many recent checkpoints to keep", minimum=1, metavar="N")
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir")


def check_checkpoint_dir(directory: str | None) -> None:
    """Create ``directory`` and write and remove a probe file in it, before any worker starts: a directory
    that cannot be written would otherwise fail every worker at its first save, one traceback each."""
    if not directory:
        return
    path = Path(directory)
    probe = path / f".polytrain-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--checkpoint-dir {directory}: cannot create or write this directory "
                          f"({exc.strerror or exc})") from None


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to ``path`` so that ``path`` is either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return path


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Writes ``step-N.pt`` files plus a ``latest`` pointer in ``directory``; keeps the newest ``keep``."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3):
        self.directory = Path(directory)
        self.keep = keep

    def save(self, state: dict[str, Any], step: int) -> Path:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = atomic_save({"format": FORMAT, "step": step, **state}, self.directory / f"step-{step:08d}.pt")
        _atomic_write_text(self.directory / LATEST, path.name + "\n")
        self._prune()
        return path

    def steps(self) -> list[int]:
        """Steps of the complete checkpoint files present, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names (or, without a pointer, the highest step)."""
        pointer = self.directory / LATEST
        if pointer.is_file():
            target = self.directory / pointer.read_text().strip()
            if target.is_file():
                return target
        steps = self.steps()
        return self.directory / f"step-{steps[-1]:08d}.pt" if steps else None

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        path = self.latest()
        return None if path is None else load_checkpoint(path, map_location)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            (self.directory / f"step-{step:08d}.pt").unlink(missing_ok=True)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # corrupt or foreign file: say which and why
        raise ConfigError(f"cannot read checkpoint {path}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"{path} is not a polytrain checkpoint (format {FORMAT})")
    return state


def capture_rng() -> dict[str, Any]:
    """This process's RNG states, in types that ``weights_only`` loading accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _listify(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_plain, np_state[2:])],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _listify(value: Any) -> Any:
    return [_listify(v) for v in value] if isinstance(value, tuple) else value


def _tuplify(value: Any) -> Any:
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value
