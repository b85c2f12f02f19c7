"""Periodic, atomic, verifiable checkpoints and resume.

A checkpoint is one ``torch.save`` file, ``step-00000100.pt``, holding the model, optimizer, step, data
position, every rank's RNG states and the resolved config. It is written to a temporary file in the same
directory and fsynced; then its manifest ``step-00000100.json`` (size, SHA-256, step, strategy, world size,
the model's tensor names/shapes/dtypes), written the same way; both are renamed into place, the manifest
first; only then does the ``latest`` pointer (itself replaced atomically) move to it. A crash at any moment
therefore leaves the previous checkpoint as the latest. A write the disk refuses (full, over quota,
read-only, I/O error) is one :class:`~polytrain.errors.CheckpointError` line naming the directory and the
bytes needed and free, and leaves everything as it was (``--on-checkpoint-error warn``: a warning, and the
run goes on). Loading checks a file against its manifest and the model it is meant for
(:mod:`polytrain.train.integrity`) and falls back to the previous good checkpoint.
Files load with ``torch.load(..., weights_only=True)``: nothing in them needs pickle's arbitrary code.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from polytrain.distributed.lifetime import end_if_orphaned
from polytrain.errors import CheckpointError, ConfigError
from polytrain.log import EVERY_RANK, get_logger
from polytrain.options import option, register_section
from polytrain.train.files import (atomic_write_text, check_room, discard, disk_problem, estimate_bytes, fsync_dir,
                                   on_disk, os_error, save_to, tmp_path, write_text_to)
from polytrain.train.integrity import (FORMAT, NAME, Signature, Verdict, build_manifest, dumps_manifest,
                                       manifest_path, sha256_file, verify)
from polytrain.train.sharded import PART, PART_FORMAT, part_path, parts_of

LATEST = "latest"
ON_ERROR = ("stop", "warn")


@register_section("checkpoint", "checkpoints", order=80)
@dataclass
class CheckpointConfig:
    checkpoint_dir: str | None = option(None, "directory for periodic checkpoints", metavar="DIR")
    checkpoint_every: int = option(0, "checkpoint every N steps (0: only at the end)", minimum=0, metavar="N")
    keep_checkpoints: int = option(3, "how many recent checkpoints to keep", minimum=1, metavar="N")
    resume: bool = option(False, "continue from the latest checkpoint in --checkpoint-dir")
    on_checkpoint_error: str = option("stop", "when a checkpoint cannot be written (disk full, I/O error): stop "
                                      "the run, or warn, go on and try again at the next checkpoint",
                                      choices=ON_ERROR)
    checkpoint_background: bool = option(False, "write the periodic checkpoints in a background thread: a step "
                                                "waits only for the copy of the state to host memory, which counts "
                                                "against --memory-limit (the last checkpoint is written in the "
                                                "foreground)")


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


@dataclass
class Choice:
    """The checkpoint to resume from: the newest usable one (None: none), and the newer ones it skipped."""

    good: Verdict | None
    rejected: list[Verdict] = field(default_factory=list)

    def no_good_message(self, directory: Path) -> str:
        """One line for a directory that has checkpoints but none usable."""
        reasons = "; ".join(f"{v.path.name} {v.problem}" for v in self.rejected)
        fix = ("resume with the model they were made with, or use another --checkpoint-dir"
               if all(v.foreign for v in self.rejected) else "start afresh with another --checkpoint-dir")
        return f"none of the {len(self.rejected)} checkpoint(s) in {directory} can be used: {reasons}; {fix}"


class Checkpointer:
    """Writes ``step-N.pt`` files, their manifests and a ``latest`` pointer in ``directory``; keeps the
    newest ``keep``. ``on_error`` (``--on-checkpoint-error``): what a write the disk refuses does, ``stop``
    (raise a CheckpointError) or ``warn`` (log it; :meth:`save` returns None)."""

    def __init__(self, directory: str | os.PathLike, keep: int = 3, on_error: str = "stop"):
        self.directory = Path(directory)
        self.keep = keep
        self.on_error = on_error
        self._written = 0  # how far a failed save had written its file

    def save(self, state: dict[str, Any], step: int, parts: list[dict[str, Any]] | None = None) -> Path | None:
        """Write step ``step``'s checkpoint and move ``latest`` to it; return its path. If the disk refuses,
        everything is as before (no new or partial file, ``latest`` unchanged) and the error is one line:
        raised, or with ``on_error="warn"`` logged as a warning and None returned."""
        full = {"format": FORMAT, "step": step, **state}
        path = self.path(step)
        existed = path.exists()
        needed = estimate_bytes(full)
        try:
            self._write(full, step, path, needed, parts)
        except (OSError, RuntimeError) as exc:
            if not isinstance(exc, OSError) and os_error(exc) is None:
                raise  # not the disk's: a bug, with its traceback
            if not existed and not self._points_to(path):  # complete, but `latest` did not move to it: undone
                self._written = max(self._written, discard(path))
                discard(manifest_path(path))
            # the file (as far as it was written, if more than the estimate), its manifest and the pointer
            problem = disk_problem(exc, self.directory, on_disk(max(needed, self._written), self.directory, files=3))
            assert problem is not None
            message = f"checkpoint {path.name}: {problem[0]}"
            if self.on_error != "warn":
                raise CheckpointError(f"{message}; {problem[1]} or give another --checkpoint-dir") from None
            get_logger().warning(f"{message}; going on without it (--on-checkpoint-error warn), the next "
                                 "checkpoint tries again", extra=EVERY_RANK)
            return None
        self._prune(step)
        return path

    def save_parts(self, meta: dict[str, Any] | None, part: dict[str, Any], step: int, group: Any) -> Path | None:
        """A sharded run's checkpoint (:mod:`polytrain.train.sharded`); collective over ``group``, the trainer
        ranks: each writes ``part`` (its pieces) as its part file, then the main rank writes ``meta`` (the
        checkpoint less the model and optimizer tensors) with a manifest listing every part, and moves
        ``latest``. A part the disk refuses anywhere undoes every part, and every rank raises the same
        CheckpointError (or, with ``on_error="warn"``, returns None; the main rank warns)."""
        return self.commit_parts(meta, self.write_part(part, step, group), step, group)

    def write_part(self, part: dict[str, Any], step: int, group: Any) -> tuple[Any, Any]:
        """This rank's part of step ``step`` under its temporary name (no collective: it may run in a thread of
        its own, :mod:`polytrain.train.background`); what :meth:`commit_parts` takes."""
        mine = part_path(self.path(step), group.rank, group.world_size)
        return self._write_part({"format": PART_FORMAT, "step": step, "rank": group.rank,
                                 "parts": group.world_size, **part}, mine)

    def commit_parts(self, meta: dict[str, Any] | None, written: tuple[Any, Any], step: int,
                     group: Any) -> Path | None:
        """The rest of :meth:`save_parts` once every rank has written its part (``written``: what
        :meth:`write_part` returned): collective over ``group``."""
        path = self.path(step)
        mine = part_path(path, group.rank, group.world_size)
        record, problem = written
        records = group.all_gather_object((record, problem))
        failed = [(rank, p) for rank, (_, p) in enumerate(records) if p is not None]
        if not failed:
            end_if_orphaned(lambda: discard(tmp_path(mine)))
            try:
                os.replace(tmp_path(mine), mine)
            except OSError as exc:
                failed_here = disk_problem(exc, self.directory, on_disk(record["size"], self.directory))
                failed = [(group.rank, failed_here or (str(exc), "free some space"))]
            failed = [f for fs in group.all_gather_object(failed) for f in fs]
        if failed:
            discard(tmp_path(mine))
            discard(mine)
            rank, (what, fix) = failed[0]
            message = f"checkpoint {path.name}: part {rank} of {group.world_size}: {what}"
            if self.on_error != "warn":
                raise CheckpointError(f"{message}; {fix} or give another --checkpoint-dir")
            if group.is_main:
                get_logger().warning(f"{message}; going on without it (--on-checkpoint-error warn), the next "
                                     "checkpoint tries again", extra=EVERY_RANK)
            return None
        if not group.is_main:
            return path
        assert meta is not None
        listed = [r for r, _ in records]
        return self.save({**meta, "sharded": {**meta["sharded"], "files": [r["file"] for r in listed]}}, step,
                         parts=listed)

    def _write_part(self, part: dict[str, Any], path: Path) -> tuple[dict[str, Any] | None, tuple[str, str] | None]:
        """This rank's part under its temporary name, fsynced: (its file, size and SHA-256; None) or (None, the
        disk's problem and its fix)."""
        tmp = tmp_path(path)
        needed = estimate_bytes(part)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            check_room(self.directory, needed)
            save_to(part, tmp)
            return {"file": path.name, "size": tmp.stat().st_size, "sha256": sha256_file(tmp)}, None
        except (OSError, RuntimeError) as exc:
            if not isinstance(exc, OSError) and os_error(exc) is None:
                raise
            written = discard(tmp)
            problem = disk_problem(exc, self.directory, on_disk(max(needed, written), self.directory))
            assert problem is not None
            return None, problem

    def _write(self, full: dict[str, Any], step: int, path: Path, needed: int,
               parts: list[dict[str, Any]] | None = None) -> None:
        """The file and its manifest are written under temporary names and renamed into place together (the
        manifest first): a ``step-N.pt`` never appears without its manifest; then ``latest`` moves."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written = 0
        check_room(self.directory, needed)
        manifest = manifest_path(path)
        data_tmp, manifest_tmp = tmp_path(path), tmp_path(manifest)
        try:
            save_to(full, data_tmp)
            # hashed from the disk after the fsync: the checksum is of the bytes a later load will read
            record = {**build_manifest(data_tmp, full, step), "file": path.name,
                      **({"parts": parts} if parts is not None else {})}
            write_text_to(manifest_tmp, dumps_manifest(record))
            end_if_orphaned(lambda: (discard(data_tmp), discard(manifest_tmp)))  # the launcher died meanwhile
            os.replace(manifest_tmp, manifest)
            try:
                os.replace(data_tmp, path)
            except OSError:
                manifest.unlink(missing_ok=True)  # it describes a file that is not there
                raise
        finally:
            self._written = discard(data_tmp)
            discard(manifest_tmp)
        fsync_dir(self.directory)
        atomic_write_text(self.directory / LATEST, path.name + "\n")

    def take(self, source: Path, step: int) -> Path:
        """Copy step ``step``'s checkpoint (its file, manifest and parts) from the directory ``source`` into this
        one and move ``latest`` to it (:mod:`polytrain.train.snapshot`); each file under a temporary name first,
        the main file renamed into place last, so a checkpoint never appears half-copied."""
        path = self.path(step)
        self.directory.mkdir(parents=True, exist_ok=True)
        names = [p.name for p in parts_of(source, step)] + [manifest_path(path).name, path.name]
        for name in names:  # (the main file last: its appearance is the checkpoint's)
            tmp = tmp_path(self.directory / name)
            try:
                shutil.copyfile(source / name, tmp)
                with open(tmp, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(tmp, self.directory / name)
            finally:
                discard(tmp)
        fsync_dir(self.directory)
        atomic_write_text(self.directory / LATEST, path.name + "\n")
        self._prune(step)
        return path

    def _points_to(self, path: Path) -> bool:
        try:
            return (self.directory / LATEST).read_text().strip() == path.name
        except OSError:
            return False

    def steps(self) -> list[int]:
        """Steps of the complete checkpoint files present, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.directory / f"step-{step:08d}.pt"

    def latest(self) -> Path | None:
        """The checkpoint the ``latest`` pointer names (or, without a pointer, the highest step)."""
        pointer = self.directory / LATEST
        if pointer.is_file():
            target = self.directory / pointer.read_text().strip()
            if target.is_file():
                return target
        steps = self.steps()
        return self.path(steps[-1]) if steps else None

    def candidates(self) -> list[Path]:
        """The order in which to try the checkpoints: the ``latest`` one, then the others, newest first."""
        latest = self.latest()
        others = [self.path(step) for step in reversed(self.steps())]
        return ([latest] if latest else []) + [p for p in others if p != latest]

    def choose(self, expected: Signature | None = None, map_location: str | torch.device = "cpu",
               lazy: bool = False) -> Choice:
        """The newest checkpoint that passes :func:`~polytrain.train.integrity.verify` (against the model
        ``expected``, if given), loaded (``lazy``: mapped, its parts not put together), with the newer ones
        that did not."""
        choice = Choice(None)
        for path in self.candidates():
            verdict = verify(path, expected, map_location, lazy)
            if verdict.ok:
                choice.good = verdict
                return choice
            choice.rejected.append(verdict)
        return choice

    def load_latest(self, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
        """The newest usable checkpoint's contents (None: no checkpoint); the ones skipped are logged as
        warnings, and a directory with checkpoints but none usable is a ConfigError."""
        choice = self.choose(map_location=map_location)
        warn_choice(choice, get_logger().warning)
        if choice.good is None:
            if choice.rejected:
                raise ConfigError(choice.no_good_message(self.directory))
            return None
        return choice.good.state

    def _prune(self, saved: int) -> None:
        # Only checkpoints up to the one just saved count: any later ones were left by a run that this
        # one resumed from before them (they were unusable), and must not push out the new ones.
        older = [step for step in self.steps() if step <= saved]
        for step in older[: -self.keep]:
            self.path(step).unlink(missing_ok=True)
            manifest_path(self.path(step)).unlink(missing_ok=True)
            for part in parts_of(self.directory, step):
                part.unlink(missing_ok=True)
        for part in self.directory.glob("step-*.part-*-of-*.pt"):  # a failed sharded write's (no main file)
            match = PART.match(part.name)
            if match and int(match.group(1)) < saved and not self.path(int(match.group(1))).exists():
                part.unlink(missing_ok=True)


def warn_choice(choice: Choice, warn: Any, prefix: str = "") -> None:
    """Log what :meth:`Checkpointer.choose` skipped and whether what it chose could be verified."""
    good = choice.good
    if good is None:  # nothing was used: the caller's one error names every file instead
        return
    for bad in choice.rejected:
        warn(f"{prefix}checkpoint {bad.describe()}; skipped for an earlier one")
    if good.manifest is None:
        warn(f"{prefix}checkpoint {good.path} has no manifest (written before polytrain checked checkpoints): "
             "its integrity cannot be verified")


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """One checkpoint file's contents, checked as :func:`~polytrain.train.integrity.verify` does; a
    ConfigError naming the file and why if it cannot be used."""
    verdict = verify(path, map_location=map_location)
    if verdict.state is None:
        raise ConfigError(f"checkpoint {verdict.describe()}")
    return verdict.state


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
