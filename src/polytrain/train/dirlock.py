"""One run per checkpoint directory: the lock file ``polytrain.lock`` in ``--checkpoint-dir``.

The launching process (under torchrun: global rank 0) holds it for the whole command, every ``--max-restarts``
attempt included. It is an ``flock`` on the file, which the kernel releases when the holder dies however it
dies, and the file names the holder: host, pid, start time and command line. A second run on the directory
is refused with one line naming the first. A lock file whose holder is gone (it names one, and nobody holds
the flock) is *stale*: taken over with one warning. The file is never deleted (another run may be opening
it); releasing clears its contents.

Where the file system has no ``flock`` (the call fails with anything but "would block"), the record alone
decides: a record of this host whose pid is not running is stale; a live pid, or another host's record that
cannot be checked from here, refuses the run, naming the file to delete if that run is over.

With the lock held nobody else writes the directory, so the temporary files a killed writer left behind
(``.step-00000100.pt.1234.tmp``, ``.latest.1234.tmp``) are removed when it is taken.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from polytrain.errors import ConfigError
from polytrain.log import get_logger

LOCK_NAME = "polytrain.lock"
#: temporary files of atomic_save / _atomic_write_text (".NAME.PID.tmp") and of check_checkpoint_dir's probe
LEFTOVER = re.compile(r"^(\..+\.\d+\.tmp|\.polytrain-probe-\d+)$")
_HELD: dict[str, int] = {}  # lock path -> fd, closed in a forked child (it must not keep the lock alive)


def _close_in_child() -> None:
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def describe(owner: dict[str, Any]) -> str:
    """``host HOST, pid PID, started TIME: COMMAND`` of an owner record."""
    started = owner.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, (int, float)) else "?"
    return (f"host {owner.get('host', '?')}, pid {owner.get('pid', '?')}, started {when}: "
            f"{owner.get('command', '?')}")


def read_owner(path: str | os.PathLike) -> dict[str, Any] | None:
    """The owner record in a lock file (None: empty, missing or unreadable)."""
    try:
        text = Path(path).read_text().strip()
        record = json.loads(text) if text else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def live_owner(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The run holding ``directory``'s lock (None: none), looked at without taking the lock: a shared flock
    tried and dropped at once (a run starting at that instant retries); without flock, the record's pid."""
    path = Path(directory) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        owner = read_owner(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                return owner or {}
            return owner if owner and _pid_alive(owner) is not False else None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def hold(directory: str | None) -> Iterator[None]:
    """Hold ``directory``'s lock for the ``with`` block (nothing to hold without a directory)."""
    if not directory:
        yield
        return
    lock = DirLock(directory)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


class DirLock:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.fd: int | None = None
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "started": round(time.time(), 3),
                       "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv else "python",
                       "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}

    def acquire(self) -> None:
        from polytrain.train.checkpoint import check_checkpoint_dir

        check_checkpoint_dir(str(self.directory))  # the directory exists and can be written, or one line
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            old = self._lock(fd)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        _HELD[str(self.path)] = fd
        if old and not (old.get("run_id") and old.get("run_id") == self.record["run_id"]):  # not torchrun's restart
            get_logger().warning(f"--checkpoint-dir {self.directory}: taking over the lock of a run that is no "
                                 f"longer running ({describe(old)})")
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(self.record) + "\n").encode(), 0)
        os.fsync(fd)
        self._remove_leftovers()

    def _lock(self, fd: int) -> dict[str, Any] | None:
        """Take the flock (or, without flock, judge the record); return the stale record taken over."""
        for attempt in range(10):  # a `checkpoint inspect` holds a shared flock for an instant: try again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return read_owner(self.path)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    return self._without_flock(exc)
            time.sleep(0.05)
        owner = read_owner(self.path)
        who = f"another run ({describe(owner)})" if owner else "another run (starting: its record is not written yet)"
        raise ConfigError(f"--checkpoint-dir {self.directory} is in use by {who}; wait for it to finish or "
                          "stop it, or give another --checkpoint-dir")

    def _without_flock(self, exc: OSError) -> dict[str, Any] | None:
        owner = read_owner(self.path)
        if not owner:
            return None
        alive = _pid_alive(owner)
        if alive is False:
            return owner
        why = "is running" if alive else "cannot be checked from this host"
        raise ConfigError(f"--checkpoint-dir {self.directory} may be in use by another run ({describe(owner)}), "
                          f"which {why}; this file system cannot lock files ({exc.strerror or exc}): if that run "
                          f"is over, delete {self.path}, or give another --checkpoint-dir")

    def release(self) -> None:
        """Clear the record and drop the lock; the file stays (another run may have it open)."""
        if self.fd is None:
            return
        _HELD.pop(str(self.path), None)
        try:
            if read_owner(self.path) == self.record:  # without flock another run may have taken it over
                os.ftruncate(self.fd, 0)
        except OSError:
            pass
        finally:
            os.close(self.fd)  # releases the flock
            self.fd = None

    def _remove_leftovers(self) -> None:
        removed = []
        for entry in self.directory.iterdir():
            if LEFTOVER.match(entry.name) and entry.is_file():
                with contextlib.suppress(OSError):
                    entry.unlink()
                    removed.append(entry.name)
        if removed:
            get_logger().info(f"--checkpoint-dir {self.directory}: removed {len(removed)} temporary file(s) a "
                              f"killed run left ({', '.join(sorted(removed)[:3])}{' ...' if len(removed) > 3 else ''})")


def _pid_alive(owner: dict[str, Any]) -> bool | None:
    """Whether the record's process runs (None: another host's, or no pid: cannot tell)."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
