"""Files written so that they are either the old ones or the complete new ones, and the one line a disk that
refuses a write gets: the directory, the bytes needed and the bytes free.

``atomic_save`` writes to a temporary file beside the target, fsyncs it and renames it into place; a
process whose launcher died ends before the rename instead (:func:`~polytrain.distributed.lifetime.end_if_orphaned`),
so nothing appears after a job's owner is gone. Temporary files a killed writer left are named
``.NAME.PID.tmp``; the checkpoint directory's lock removes them (:mod:`polytrain.train.dirlock`).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from polytrain.distributed.lifetime import end_if_orphaned
from polytrain.errors import CheckpointError


#: what a disk says when it cannot take a file: full, over quota, failing, read-only, file too large
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EFBIG)


def atomic_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` to ``path`` so that ``path`` is either the old file or the complete new one. A write the
    disk refuses is a CheckpointError line (see :func:`disk_problem`), with no temporary file left."""
    path = Path(path)
    needed, written = estimate_bytes(obj), 0
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        check_room(path.parent, needed)
        tmp = tmp_path(path)
        try:
            save_to(obj, tmp)
            end_if_orphaned(lambda: discard(tmp))
            os.replace(tmp, path)
        finally:
            written = discard(tmp)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as exc:
        error = os_error(exc)
        if error is None or error.errno not in (*DISK_ERRNOS, None):
            raise  # not the disk's (a bad path, say): the caller's to report
        problem = disk_problem(exc, path.parent, on_disk(max(needed, written), path.parent))
        assert problem is not None
        raise CheckpointError(f"cannot write {path}: {problem[0]}; {problem[1]} or give another path") from None
    return path


def tmp_path(path: Path) -> Path:
    """Where ``path`` is written before it is renamed into place (a leftover of a killed writer:
    :mod:`polytrain.train.dirlock` removes it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def discard(tmp: Path) -> int:
    """Remove a file if it is there (errors ignored); return its size (0: it was not there, or stays)."""
    try:
        size = tmp.stat().st_size
        tmp.unlink()
    except OSError:  # not there (renamed into place, or never written)
        return 0
    return size


def save_to(obj: Any, tmp: Path) -> None:
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


def write_text_to(tmp: Path, text: str) -> None:
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    tmp = tmp_path(path)
    try:
        write_text_to(tmp, text)
        end_if_orphaned(lambda: discard(tmp))
        os.replace(tmp, path)
    finally:
        discard(tmp)
    fsync_dir(path.parent)


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


def on_disk(size: int, directory: Path, files: int = 1) -> int:
    """What ``size`` bytes in ``files`` files take on the file system: each file rounded up to its blocks."""
    try:
        block = os.statvfs(directory).f_frsize or 4096
    except (OSError, AttributeError):
        block = 4096
    return -(-size // block) * block + (files - 1) * block


def check_room(directory: Path, needed: int) -> None:
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
    error = os_error(exc)
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
        needs = f"needs about {size(needed)}" if needed else "needs more"
        fix = "free space under your quota" if error.errno == errno.EDQUOT else "free space"
        return f"{reason} in {directory} ({needs}{f', {size(free)} free' if free is not None else ''})", fix
    name = errno.errorcode.get(error.errno or 0)
    return f"{reason} in {directory}{f' ({name})' if name else ''}", "check the disk"


def os_error(exc: BaseException) -> OSError | None:
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


def size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n} {unit}" if unit == "B" else f"{n:.0f} {unit}" if n >= 10 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.0f} TB"


def fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
