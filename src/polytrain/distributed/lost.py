"""Ranks a job may go on without (``--tolerate-worker-loss``), and which of them were lost.

One :class:`LostRanks` per process, on its :class:`~polytrain.distributed.topology.Topology` (``topology.lost``).
The launcher fills in the expendable ranks; the heartbeat's thread reports each expendable rank that dies
(silent past ``--heartbeat-timeout``, never started, or failed with an error) instead of ending this process;
whoever must react (a parameter server requeueing the lost worker's slices) listens.

A report comes from the heartbeat's thread, so listeners run there: they should hand the news over (a queue,
an event), not block.
"""

from __future__ import annotations

import threading
import traceback
from typing import Callable, Iterable

from polytrain.log import EVERY_RANK, get_logger

Listener = Callable[[int, str], None]


class LostRanks:
    """Which ranks a job may go on without (expendable) and which of them were lost; thread-safe."""

    def __init__(self, expendable: Iterable[int] = ()):
        self.expendable: frozenset[int] = frozenset(int(rank) for rank in expendable)
        self._lost: dict[int, str] = {}
        self._listeners: list[Listener] = []
        self._lock = threading.Lock()

    def report(self, rank: int, reason: str) -> bool:
        """``rank`` is lost, because ``reason``; True when this is news (every listener is then called with
        ``(rank, reason)``, in this thread). A rank that is not expendable is a ValueError: its loss ends the
        job, and whoever saw it must say so instead."""
        if rank not in self.expendable:
            raise ValueError(f"rank {rank} is not expendable (expendable: {sorted(self.expendable) or 'none'}); "
                             "its loss ends the job")
        with self._lock:
            if rank in self._lost:
                return False
            self._lost[rank] = reason
            listeners = list(self._listeners)
        # outside the lock: a listener may read this registry, or listen, without deadlocking
        for fn in listeners:
            _call(fn, rank, reason)
        return True

    def listen(self, fn: Listener) -> None:
        """Call ``fn(rank, reason)`` for every loss: at once for those already reported, then as they come."""
        with self._lock:
            self._listeners.append(fn)
            already = list(self._lost.items())
        for rank, reason in already:
            _call(fn, rank, reason)

    def revive(self, rank: int) -> None:
        """``rank`` is back (``--on-failure continue``: a replacement took its place): no longer lost, and the
        heartbeat watches it again."""
        with self._lock:
            self._lost.pop(rank, None)

    def lost(self) -> dict[int, str]:
        """The ranks lost so far and why (a copy)."""
        with self._lock:
            return dict(self._lost)

    def __contains__(self, rank: object) -> bool:
        with self._lock:
            return rank in self._lost

    def __repr__(self) -> str:
        return f"LostRanks(expendable={sorted(self.expendable)}, lost={sorted(self.lost())})"


def _call(fn: Listener, rank: int, reason: str) -> None:
    """One listener's bug must not keep the news from the others, nor end the heartbeat's thread (which would
    stop watching every rank)."""
    try:
        fn(rank, reason)
    except Exception as exc:
        get_logger().warning(f"a listener for lost ranks failed on rank {rank}: {type(exc).__name__}: {exc}\n"
                             f"{traceback.format_exc()}", extra=EVERY_RANK)
