"""Where a parameter server's loop takes its next event from: request headers and, with expendable workers
(``--tolerate-worker-loss``), the news that one was lost.

Without expendable workers the loop receives each request header itself (one receive from any worker, bounded
by the job's timeout). With them, it must also wake up when the heartbeat reports a lost worker, while it waits
for a message that may never come; a gloo receive cannot be polled (``is_completed`` stays False until
``wait``) nor waited on with a short timeout (a timeout closes the group's connections). So a thread of its own
waits in the receives and queues each header; the heartbeat's thread queues the losses into the same queue.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from polytrain.distributed.p2p import Channel
from polytrain.errors import CommunicationError

if TYPE_CHECKING:
    from polytrain.distributed.lost import LostRanks


@dataclass(frozen=True)
class Event:
    """A request ``header`` (kind, sender, a, b, c, d), or a ``lost`` worker rank and why."""

    header: list[int] | None = None
    lost: int | None = None
    reason: str = ""


class Inbox:
    """Request headers received on ``tag``, one at a time, from the loop's own thread."""

    def __init__(self, channel: Channel, tag: int, expected: Callable[[], str]):
        self.channel, self.tag, self.expected = channel, tag, expected

    def next(self) -> Event:
        return Event(header=self.channel.recv_header_any(self.tag, self.expected()))


class WatchedInbox(Inbox):
    """Headers received by a thread of their own, and lost workers reported by ``lost``, in arrival order."""

    def __init__(self, channel: Channel, tag: int, expected: Callable[[], str], lost: LostRanks):
        super().__init__(channel, tag, expected)
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        lost.listen(lambda rank, reason: self._events.put(Event(lost=rank, reason=reason)))
        # a daemon: after the last worker's "done" its receive stays posted; the process ends without it
        threading.Thread(target=self._receive, name="polytrain-ps-inbox", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                header = self.channel.recv_header_any(self.tag, "any worker")
            except CommunicationError as exc:
                self._events.put(exc)
                return
            self._events.put(Event(header=header))

    def next(self) -> Event:
        event = self._events.get()
        if isinstance(event, CommunicationError):
            raise CommunicationError(f"{self.channel.me}: no message within "
                                     f"{self.channel.timeout.total_seconds():g} s from {self.expected()}; "
                                     "they died or hang (raise --timeout if they are only slow)") from event
        return event
