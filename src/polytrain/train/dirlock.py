"""One run per checkpoint directory: the lock file ``polytrain.lock`` in ``--checkpoint-dir``.

The launching process (under torchrun: global rank 0) holds it for the whole command, all ``--max-restarts``
attempts: an ``flock``, which the kernel releases when the holder dies, however it dies. The file names the
holder (host, pid, start time, command line); a second run is refused with one line naming it. A lock file
naming a holder while nobody holds the flock is *stale*: taken over with one warning. The file is never
deleted (another run may be opening it): releasing clears it. Where the file system has no ``flock`` (it
fails with anything but "would block"), the record decides: this host's record with a dead pid is stale; a
live pid, or another host's record, refuses the run, naming the file to delete if that run is over.
What a killed writer left (``.step-00000100.pt.1234.tmp``, ``.latest.1234.tmp``, a manifest without its file)
is removed once the lock is held: nobody else writes the directory then.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError
from polytrain.log import get_logger, setup_logging

LOCK_NAME = "polytrain.lock"
LEFTOVER = re.compile(r"^(\..+\.\d+\.tmp|\.polytrain-probe-\d+)$")  # atomic_save's, check_checkpoint_dir's
MANIFEST = re.compile(r"^(step-\d{8,})\.json$")  # one whose step-N.pt is missing: a save killed between renames
_HELD: dict[str, int] = {}  # lock path -> fd; a forked child closes it (it must not keep the lock alive)
os.register_at_fork(after_in_child=lambda: [os.close(_HELD.pop(path)) for path in list(_HELD)])


def describe(owner: dict[str, Any]) -> str:
    """``host HOST, pid PID, started TIME: COMMAND`` of an owner record."""
    at = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if isinstance(at, (int, float)) else "?"
    return f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started {when}: {owner.get('command', '?')}"


def read_owner(path: str | os.PathLike) -> dict[str, Any] | None:
    """The owner record in a lock file (None: empty, missing or unreadable)."""
    try:
        record = json.loads(Path(path).read_text() or "null")
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def live_owner(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The run holding ``directory``'s lock (None: none), without taking it: a shared flock tried and dropped
    at once (a run starting in that instant tries again); without flock, the record's pid."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        owner = read_owner(path)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # closing the file drops it
        return None
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            return owner or {}
        return owner if owner and _pid_alive(owner) is not False else None
    finally:
        os.close(fd)


def hold(directory: str | None) -> contextlib.AbstractContextManager[Any]:
    """``with hold(directory):`` holds its lock for the block (nothing to hold without a directory)."""
    return DirLock(directory) if directory else contextlib.nullcontext()


class DirLock:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.fd: int | None = None
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": round(time.time(), 3),
                       "command": _command(), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}

    def acquire(self) -> None:
        from polytrain.train.checkpoint import check_checkpoint_dir

        check_checkpoint_dir(str(self.directory))  # the directory exists and can be written, or one line
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise self._unwritable(exc) from None
        try:
            old = self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = _HELD[str(self.path)] = fd
        if old and not (old.get("run_id") and old.get("run_id") == self.record["run_id"]):  # not torchrun's restart
            _logger().warning(f"--checkpoint-dir {self.directory}: taking over the lock of a run that is no "
                              f"longer running ({describe(old)})")
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(self.record) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as exc:
            self.release()
            raise self._unwritable(exc) from None
        self._remove_leftovers()

    def _unwritable(self, exc: OSError) -> ConfigError:
        fix = "free space" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "remove it"
        return ConfigError(f"--checkpoint-dir {self.directory}: cannot write its lock file {self.path} "
                           f"({exc.strerror or exc}); {fix} or give another --checkpoint-dir")

    def _lock(self, fd: int) -> dict[str, Any] | None:
        """Take the flock (without flock: judge the record); return the stale record taken over, if any."""
        for _ in range(10):  # a `checkpoint inspect` holds a shared flock for an instant: try again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return read_owner(self.path)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return self._without_flock(exc)
            time.sleep(0.05)
        owner = read_owner(self.path)
        who = describe(owner) if owner else "starting: its record is not written yet"
        raise ConfigError(f"--checkpoint-dir {self.directory} is in use by another run ({who}); wait for it to "
                          "finish or stop it, or give another --checkpoint-dir")

    def _without_flock(self, exc: OSError) -> dict[str, Any] | None:
        owner = read_owner(self.path)
        if not owner or (alive := _pid_alive(owner)) is False:
            return owner
        why = "is running" if alive else "cannot be checked from this host"
        raise ConfigError(f"--checkpoint-dir {self.directory} may be in use by another run ({describe(owner)}), "
                          f"which {why}; this file system cannot lock files ({exc.strerror or exc}): if that run "
                          f"is over, delete {self.path}, or give another --checkpoint-dir")

    def __enter__(self) -> "DirLock":
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def release(self) -> None:
        """Clear the record and drop the lock; the file stays (another run may have it open)."""
        if self.fd is None:
            return
        _HELD.pop(str(self.path), None)
        if read_owner(self.path) == self.record:  # without flock another run may have taken it over
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
        os.close(self.fd)  # releases the flock
        self.fd = None

    def _remove_leftovers(self) -> None:
        removed = []
        for entry in self.directory.iterdir():
            manifest = MANIFEST.match(entry.name)
            orphan = manifest and not (self.directory / f"{manifest.group(1)}.pt").exists()
            if (LEFTOVER.match(entry.name) or orphan) and entry.is_file():
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry.name)
        if removed:
            _logger().info(f"--checkpoint-dir {self.directory}: removed what a killed run left: "
                           f"{', '.join(sorted(removed))}")


def _logger() -> Any:  # the lock is taken before launch() sets up the launcher's logging
    return get_logger() if get_logger().handlers else setup_logging()


def _command() -> str:
    """This process's command line, as typed (``python -m polytrain`` for the module's ``__main__``)."""
    argv = list(sys.argv) or ["python"]
    main = Path(argv[0]).name == "__main__.py"
    return " ".join([f"python -m {Path(argv[0]).parent.name}" if main else shlex.quote(Path(argv[0]).name),
                     shlex.join(argv[1:])]).strip()


def _pid_alive(owner: dict[str, Any]) -> bool | None:
    """Whether the record's process runs (None: another host's, or no pid: cannot tell)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True
