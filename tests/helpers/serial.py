"""Tests that run alone while the suite runs on several pytest-xdist workers (``make test``: ``pytest -n 2``).

A test marked ``serial`` (today: the network lab's rate test and async
--tolerate-worker-loss's module) runs while no other test runs, and the other worker idles meanwhile: keep it for
what needs the machine to itself. A heartbeat
bound of 3-4 s (tests/distributed/test_heartbeat.py) holds beside the other worker and a CPU burner, and a test
that waits for a detected event can give it a wide bound: neither needs the mark.

Every test holds a shared lock on one file for its whole protocol (setup, call, teardown), a ``serial`` one an
exclusive lock. A turnstile lock in front keeps a waiting ``serial`` test
from being overtaken by the next shared ones forever. Consecutive serial tests on one worker (a serial module's,
under ``--dist loadscope``) keep the exclusive lock from one to the next: the other worker's current test is
waited for once, not before each of them. Without xdist nothing is locked."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import Iterator


class SuiteLock:
    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self._turnstile = os.open(directory / "polytrain-turnstile.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._tests = os.open(directory / "polytrain-serial.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._alone = False  # this worker holds the exclusive lock still, from the serial test before

    @contextlib.contextmanager
    def held(self, alone: bool, keep: bool = False) -> Iterator[None]:
        """The lock for one test: shared, or exclusive where ``alone``; ``keep``: a serial test followed by
        another serial one on this worker keeps the exclusive lock for it, so that the other worker's current
        test is waited for once per run of serial tests, not once per test."""
        if not (alone and self._alone):
            if self._alone:  # (kept for a serial test that did not come)
                self._release()
            fcntl.flock(self._turnstile, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._tests, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
            finally:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            self._alone = alone
        try:
            yield
        finally:
            if not (alone and keep):
                self._release()

    def _release(self) -> None:
        fcntl.flock(self._tests, fcntl.LOCK_UN)
        self._alone = False


def suite_lock(config) -> SuiteLock | None:
    """The lock shared by this run's xdist workers (their base temporary directories' parent), None when this
    process is not an xdist worker."""
    if not hasattr(config, "workerinput") or not config.option.basetemp:
        return None
    return SuiteLock(Path(config.option.basetemp).parent)
