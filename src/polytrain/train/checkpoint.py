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

import errno
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
from polytrain.log import get_logger
from polytrain.options import option, register_section
from polytrain.train.integrity import (FORMAT, NAME, Signature, Verdict, build_manifest, dumps_manifest,
                                       manifest_path, verify)

LATEST = "latest"
ON_ERROR = ("stop", "warn")
#: what a disk says when it cannot take a file: full, over quota, failing, read-only, file too large
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG)


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
    """``torch.save`` to ``path`` so that ``path`` is either the old file or the complete new one. A write the
    disk refuses is a CheckpointError line (see :func:`disk_problem`), with no temporary file left."""
    path = Path(path)
    needed, written = estimate_bytes(obj), 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_room(path.parent, needed)
        tmp = _tmp_path(path)
        try:
            _save_to(obj, tmp)
            end_if_orphaned(lambda: _discard(tmp))
            os.replace(tmp, path)
        finally:
            written = _discard(tmp)
        _fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        error = _os_error(exc)
        if error is None or error.errno not in (*DISK_ERRNOS, None):
            raise  # not the disk's (a bad path, say): the caller's to report
        problem = disk_problem(exc, path.parent, _on_disk(max(needed, written), path.parent))
        assert problem is not None
        raise CheckpointError(f"cannot write {path}: {problem[0]}; {problem[1]} or give another path") from None
    return path


def _tmp_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (a leftover of a killed writer:
    :mod:`polytrain.train.dirlock` removes it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def _discard(tmp: Path) -> int:
    """Remove a file if it is there (errors ignored); return its size (0: it was not there, or stays)."""
    try:
        size = tmp.stat().st_size
        tmp.unlink()
    except OSError:  # not there (renamed into place, or never written)
        return 0
    return size


def _save_to(obj: Any, tmp: Path) -> None:
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def _write_text_to(tmp: Path, text: str) -> None:
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = _tmp_path(path)
    try:
        _write_text_to(tmp, text)
        end_if_orphaned(lambda: _discard(tmp))
        os.replace(tmp, path)
    finally:
        _discard(tmp)
    _fsync_dir(path.parent)


def estimate_bytes(obj: Any) -> int:
    """About the size of ``torch.save(obj)`` (a little less, so that a check against it never refuses a file
    that fits): its tensors' storages (each once), a record each, and the pickle of everything else."""
    seen: dict[tuple[str, int], int] = {}
    containers: set[int] = set()

    def walk(value: Any) -> int:  # the pickle's bytes for what is not a tensor's storage, about
        if isinstance(value, (dict, list, tuple)):
            if id(value) in containers:  # pickled once, referred to after
                return 5
            containers.add(id(value))
        if isinstance(value, torch.Tensor):
            try:
                storage = value.untyped_storage()
                seen[(str(value.device), storage.data_ptr())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
                seen[("other", id(value))] = value.numel() * value.element_size()
            return 0
        if isinstance(value, dict):
            return 2 + sum(walk(key) + walk(item) for key, item in value.items())
        if isinstance(value, (list, tuple)):
            return 2 + sum(walk(item) for item in value)
        if isinstance(value, (str, bytes)):
            return 5 + len(value)
        return 5  # a number, None; anything else is not pickled here (its __reduce__ may do anything)

    rest = walk(obj)
    # a record per storage: its zip headers and alignment, its reference in the pickle; 5 small records more
    return sum(seen.values()) + 256 * len(seen) + rest + 512


def _on_disk(size: int, directory: Path, files: int = 1) -> int:
    """What ``size`` bytes in ``files`` files take on the file system: each file rounded up to its blocks."""
    try:
        block = os.statvfs(directory).f_frsize or 4096
    except (OSError, AttributeError):
        block = 4096
    return -(-size // block) * block + (files - 1) * block


def _check_room(directory: Path, needed: int) -> None:
    """Refuse a write that cannot fit before writing anything (a full disk mid-write is handled anyway)."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return
    if free < needed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def disk_problem(exc: BaseException, directory: Path, needed: int | None) -> tuple[str, str] | None:
    """What a failed write says about the disk, and the fix: ("no space left on device in runs/c10 (needs
    about 442 kB, 12 kB free)", "free space"). None: not the disk's error (a bug: it keeps its traceback).
    torch.save raises a RuntimeError ("unexpected pos ...") with the OSError as its cause or context."""
    error = _os_error(exc)
    if error is None:
        return None
    try:
        free: int | None = shutil.disk_usage(directory).free
    except OSError:
        free = None
    if error.errno is None and needed and free is not None and free < needed:  # torch's stream said no more
        error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    reason = (error.strerror or str(error)).rstrip(".")
    reason = reason[:1].lower() + reason[1:]
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        needs = f"needs about {_size(needed)}" if needed else "needs more"
        fix = "free space under your quota" if error.errno == errno.EDQUOT else "free space"
        return f"{reason} in {directory} ({needs}{f', {_size(free)} free' if free is not None else ''})", fix
    name = errno.errorcode.get(error.errno or 0)
    return f"{reason} in {directory}{f' ({name})' if name else ''}", "check the disk"


def _os_error(exc: BaseException) -> OSError | None:
    """``exc`` if an OSError; for torch.save's write failure, the OSError it wraps (an errno-less one
    with torch's words if it wraps none). None: anything else."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in ("unexpected pos", "iostream error",
                                                                            "file write failed")):
        for linked in (exc.__cause__, exc.__context__):
            if isinstance(linked, OSError):
                return linked
        return OSError(f"the file could not be written ({str(exc).strip().splitlines()[0]})")
    return None


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.0f} {unit}" if n >= 10 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    def save(self, state: dict[str, Any], step: int) -> Path | None:
        """Write step ``step``'s checkpoint and move ``latest`` to it; return its path. If the disk refuses,
        everything is as before (no new or partial file, ``latest`` unchanged) and the error is one line:
        raised, or with ``on_error="warn"`` logged as a warning and None returned."""
        full = {"format": FORMAT, "step": step, **state}
        path = self.path(step)
        existed = path.exists()
        needed = estimate_bytes(full)
        try:
            self._write(full, step, path, needed)
        except (OSError, RuntimeError) as exc:
            if not isinstance(exc, OSError) and _os_error(exc) is None:
                raise  # not the disk's: a bug, with its traceback
            if not existed and not self._points_to(path):  # complete, but `latest` did not move to it: undone
                self._written = max(self._written, _discard(path))
                _discard(manifest_path(path))
            # the file (as far as it was written, if more than the estimate), its manifest and the pointer
            problem = disk_problem(exc, self.directory, _on_disk(max(needed, self._written), self.directory, files=3))
            assert problem is not None
            message = f"checkpoint {path.name}: {problem[0]}"
            if self.on_error != "warn":
                raise CheckpointError(f"{message}; {problem[1]} or give another --checkpoint-dir") from None
            get_logger().warning(f"{message}; going on without it (--on-checkpoint-error warn), the next "
                                 "checkpoint tries again")
            return None
        self._prune(step)
        return path

    def _write(self, full: dict[str, Any], step: int, path: Path, needed: int) -> None:
        """The file and its manifest are written under temporary names and renamed into place together (the
        manifest first): a ``step-N.pt`` never appears without its manifest; then ``latest`` moves."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._written = 0
        _check_room(self.directory, needed)
        manifest = manifest_path(path)
        data_tmp, manifest_tmp = _tmp_path(path), _tmp_path(manifest)
        try:
            _save_to(full, data_tmp)
            # hashed from the disk after the fsync: the checksum is of the bytes a later load will read
            record = {**build_manifest(data_tmp, full, step), "file": path.name}
            _write_text_to(manifest_tmp, dumps_manifest(record))
            end_if_orphaned(lambda: (_discard(data_tmp), _discard(manifest_tmp)))  # the launcher died meanwhile
            os.replace(manifest_tmp, manifest)
            try:
                os.replace(data_tmp, path)
            except OSError:
                manifest.unlink(missing_ok=True)  # it describes a file that is not there
                raise
        finally:
            self._written = _discard(data_tmp)
            _discard(manifest_tmp)
        _fsync_dir(self.directory)
        _atomic_write_text(self.directory / LATEST, path.name + "\n")

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

    def choose(self, expected: Signature | None = None, map_location: str | torch.device = "cpu") -> Choice:
        """The newest checkpoint that passes :func:`~polytrain.train.integrity.verify` (against the model
        ``expected``, if given), loaded, with the newer ones that did not."""
        choice = Choice(None)
        for path in self.candidates():
            verdict = verify(path, expected, map_location)
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
