"""Point-to-point tensor messages through shared memory, between ranks on one machine.

:class:`~polytrain.distributed.p2p.Channel` sends through gloo, whose every message goes through gloo's own
threads on both sides (and a large one through the kernel's socket buffers, in pieces). On a machine whose
cores are busy computing, each of those threads must be scheduled before a message moves: with two ``async``
workers and one parameter server on two cores, a worker waited 7.7-10 ms for each answer through gloo against a
6-7 ms slice, and 3.5-4.1 ms through the mailboxes below (docs/async-ps.md). torch has no shared-memory transport
for point-to-point messages between CPU processes.

:class:`SharedMemoryChannel` keeps the channel's calls and meaning, and moves the messages between the pairs of
ranks its :class:`MailboxLayout` names through a file in /dev/shm that every rank maps:

* each ordered pair (sender, receiver) has a ring of ``capacity`` bytes with two counters, the bytes written
  (``head``, the sender's alone) and the bytes read (``tail``, the receiver's alone);
* a message is a 64-byte frame header (its tag and size) and the tensor's bytes, written by the sender itself
  into the ring; a message larger than the free space is written piece by piece as the receiver reads;
* each rank has a doorbell, a counter that a sender moves after writing and that a waiting receiver sleeps on (a
  futex: no CPU used while waiting, woken at once);
* messages of one pair are read in order; a receive for one tag that finds another at the front of its pair's
  ring keeps that one aside for the receive that wants it, as gloo matches by tag.

A send returns once its bytes are in the ring (it waits only while the ring is full, as gloo's would for the
socket). Every wait is bounded by the channel's timeout, and a wait on one peer (a receive from it, or a send to
it while its ring is full) checks every 0.1 s whether that process still exists: one that ended is named at once
("connection lost ... it exited or crashed"), as gloo names a closed connection. A receive from any rank does not
check (as gloo's does not). Pairs the layout does not name go through gloo as before.

The file is unlinked as soon as every rank has mapped it, so a killed job leaves nothing behind. x86-64 Linux only,
as shm.py: a sender writes the bytes, then the head; a receiver reads the head, then the bytes (stores and loads in
program order).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from polytrain.distributed import futex
from polytrain.distributed.p2p import Channel, Message
from polytrain.distributed.shm import SHM_DIR, ShmPlan, gather_facts, map_shared, refusal, round_up
from polytrain.errors import CommunicationError

FRAME = 64  # bytes: a frame header, and the alignment of every frame
_MAGIC = 0x706F6C79  # "poly": a frame header's first word
_STRIDE = 16  # int64s per counter: 128 bytes each, so no two share a cache line pair
_PAGE = 4096
_SLICE_S = 0.02  # the longest single sleep: a wake-up lost to two senders ringing at once costs at most this
_LIVENESS_S = 0.1  # how often a wait on one peer checks that its process still exists


@dataclass(frozen=True)
class MailboxLayout:
    """The rings of ``pairs`` (sender, receiver), ``capacity`` bytes each, and one doorbell per rank of a group of
    ``ranks``: where each lies in the region. Pure data, the same on every rank."""

    ranks: int
    pairs: tuple[tuple[int, int], ...]
    capacity: int

    @property
    def counters_bytes(self) -> int:
        return round_up((2 * len(self.pairs) + self.ranks) * _STRIDE * 8, _PAGE)

    @property
    def total_bytes(self) -> int:
        return self.counters_bytes + len(self.pairs) * self.capacity

    @classmethod
    def for_messages(cls, ranks: int, pairs: Sequence[tuple[int, int]], largest_bytes: int) -> "MailboxLayout":
        """Rings that hold two of the largest message with room to spare (a larger one streams through)."""
        capacity = round_up(max(2 * (largest_bytes + FRAME) + (64 << 10), 1 << 20), _PAGE)
        return cls(ranks, tuple(pairs), min(capacity, 256 << 20))


def plan_mailboxes(*, machine: str, system: str, machine_ids: Sequence[str], free_bytes: int | None,
                   need_bytes: int) -> ShmPlan:
    """Whether the messages may go through shared memory (the same facts give every rank the same answer)."""
    refused = refusal(machine=machine, system=system, machine_ids=list(machine_ids), free_bytes=free_bytes,
                      ranks="ranks")
    if refused:
        return ShmPlan(False, refused)
    if need_bytes > free_bytes // 2:
        return ShmPlan(False, f"{SHM_DIR} has {free_bytes >> 20} MiB free and the mailboxes need "
                              f"{need_bytes >> 20} MiB; enlarge it (docker run --shm-size=1g)")
    return ShmPlan(True, "")


def gather_mailbox_plan(topology: Any, layout: MailboxLayout) -> ShmPlan:
    """Every rank states its machine and its /dev/shm; all decide alike (a collective over ``topology``)."""
    return plan_mailboxes(need_bytes=layout.total_bytes, **gather_facts(topology))


class SharedMemoryChannel(Channel):
    """A :class:`Channel` whose messages between the layout's pairs go through ``mapping`` (the module's
    docstring); ``pids[r]`` is the process of rank ``r`` (for telling a dead peer from a slow one; empty: the
    ranks do not see each other's processes, and only the timeout tells)."""

    def __init__(self, channel: Channel, mapping: torch.Tensor, layout: MailboxLayout, pids: Sequence[int]):
        super().__init__(channel.group, channel.timeout, channel.names, channel.me)
        self.layout, self.pids, self.path = layout, list(pids), ""
        self._mapping = mapping  # keeps the pages mapped
        self._index = {pair: i for i, pair in enumerate(layout.pairs)}
        counters = mapping[:layout.counters_bytes].view(torch.int64).view(-1, _STRIDE)[:, 0]
        self._heads, self._tails = counters[0:2 * len(layout.pairs):2], counters[1:2 * len(layout.pairs):2]
        self._bells = counters[2 * len(layout.pairs):2 * len(layout.pairs) + layout.ranks]
        self._head = [0] * len(layout.pairs)  # what this rank wrote to each pair it sends on
        self._tail = [0] * len(layout.pairs)  # what this rank read of each pair it receives on
        self._sources = [src for src, dst in layout.pairs if dst == self.rank]
        self._next_source = 0  # where a receive from any rank starts looking (each in turn)
        self._aside: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self._use_futex = futex.available()
        self._waits = threading.local()  # each thread's last check of a peer's process

    @classmethod
    def open(cls, channel: Channel, topology: Any, layout: MailboxLayout) -> "SharedMemoryChannel":
        """Create (rank 0) and map (every rank) the region; a collective over ``topology``."""
        mapping, path, pids = map_shared(topology, layout.total_bytes, "mailboxes", "shared-memory messages failed",
                                         "pass --ps-comm backend", extra=os.getpid())
        # a peer's process is checked only where every rank sees every other's (one process namespace)
        seen = topology.all_gather_object(all(_alive(pid) for pid in pids))
        opened = cls(channel, mapping, layout, pids if all(seen) else [])
        opened.path = path
        return opened

    # -- the channel's calls ------------------------------------------------------------------------

    def post(self, sends: Sequence[Message] = (), recvs: Sequence[Message] = ()) -> list[Any]:
        """Every receive posted (to gloo for a pair without a mailbox; done in :meth:`complete` otherwise), then
        every send (into its ring now, or to gloo)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        gloo_recvs = [m for m in recvs if (m[1], self.rank) not in self._index]
        gloo_sends = [m for m in sends if (self.rank, m[1]) not in self._index]
        posted: list[Any] = list(super().post(recvs=gloo_recvs)) if gloo_recvs else []
        posted += [("recv", m) for m in recvs if (m[1], self.rank) in self._index]
        for tensor, dst, tag in sends:
            if (self.rank, dst) in self._index:
                self._send(tensor, dst, tag, deadline)
        return posted + (list(super().post(sends=gloo_sends)) if gloo_sends else [])

    def complete(self, posted: Sequence[Any]) -> None:
        deadline = time.monotonic() + self.timeout.total_seconds()
        for item in posted:
            if item[0] == "recv":
                tensor, src, tag = item[1]
                self._recv(tensor, src, tag, deadline)
            else:
                work, doing = item
                self._wait(work, doing, deadline)

    def recv_any(self, tensor: torch.Tensor, tag: int, expected: str) -> torch.Tensor:
        """From whichever rank sent first, by mailbox if any has one for ``tag``; ``expected`` names who could."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        doing = f"waiting for a message from {expected}"
        while True:
            with self._recv_lock:
                bell = int(self._bells[self.rank])
                for src in self._sources:
                    if self._aside[(src, tag)]:
                        return self._fill(tensor, self._aside[(src, tag)].popleft(), src)
                count = len(self._sources)
                for k in range(count):
                    src = self._sources[(self._next_source + k) % count]
                    front = self._front(self._index[(src, self.rank)])
                    if front is not None and front[0] == tag:
                        self._next_source = (self._next_source + k + 1) % count
                        self._read_frame(src, front[1], tensor, deadline)
                        return tensor
            self._sleep(bell, deadline, doing, None)

    # -- sending ----------------------------------------------------------------------------------------

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, deadline: float) -> None:
        data = tensor.detach().reshape(-1).contiguous().view(torch.uint8)
        frame = torch.tensor([_MAGIC, tag, data.numel(), 0, 0, 0, 0, 0], dtype=torch.int64).view(torch.uint8)
        pair = self._index[(self.rank, dst)]
        with self._send_lock:
            self._write(pair, dst, (frame, data), round_up(data.numel(), FRAME) - data.numel(), deadline)

    def _write(self, pair: int, dst: int, pieces: tuple[torch.Tensor, ...], pad: int, deadline: float) -> None:
        """``pieces`` then ``pad`` bytes into the ring of ``pair`` as it has room: the head published (and the
        doorbell rung) once for a message that fits, after each piece written otherwise."""
        cap, ring, head = self.layout.capacity, self._ring(pair), self._head[pair]
        whole = cap - (head - int(self._tails[pair])) >= sum(p.numel() for p in pieces) + pad
        for piece, size in [(p, p.numel()) for p in pieces] + [(None, pad)]:
            offset = 0
            while offset < size:
                free = cap - (head - int(self._tails[pair]))
                if free == 0:
                    self._publish(pair, dst, head)
                    self._sleep_on_tail(pair, head - cap, deadline, dst)
                    continue
                start = head % cap
                n = min(size - offset, free, cap - start)
                if piece is not None:
                    ring[start:start + n].copy_(piece[offset:offset + n])
                head, offset = head + n, offset + n
                if not whole:
                    self._publish(pair, dst, head)
        self._publish(pair, dst, head)

    def _publish(self, pair: int, dst: int, head: int) -> None:
        if head == self._head[pair]:
            return
        self._head[pair] = head
        self._heads[pair] = head  # after the bytes (x86-64 keeps stores in order)
        self._bells[dst] = int(self._bells[dst]) + 1
        if self._use_futex:
            futex.wake(self._bells[dst].data_ptr())

    def _sleep_on_tail(self, pair: int, below: int, deadline: float, dst: int) -> None:
        """Until the receiver of ``pair`` has read past ``below`` (room in its ring), bounded."""
        while (tail := int(self._tails[pair])) <= below:
            now = time.monotonic()
            self._check(now, deadline, f"sending to {self.names(dst)}", dst if self._due(now) else None)
            if self._use_futex:
                futex.wait(self._tails[pair].data_ptr(), tail, min(deadline - now, _SLICE_S))
            else:
                time.sleep(5e-5)

    # -- receiving --------------------------------------------------------------------------------------

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, deadline: float) -> None:
        pair = self._index[(src, self.rank)]
        while True:
            with self._recv_lock:
                bell = int(self._bells[self.rank])
                if self._aside[(src, tag)]:
                    self._fill(tensor, self._aside[(src, tag)].popleft(), src)
                    return
                front = self._front(pair)
                if front is not None:
                    if front[0] == tag:
                        self._read_frame(src, front[1], tensor, deadline)
                        return
                    kept = torch.empty(front[1], dtype=torch.uint8)  # another tag's: kept for its receive
                    self._read_frame(src, front[1], kept, deadline)
                    self._aside[(src, front[0])].append(kept)
                    continue
            self._sleep(bell, deadline, f"waiting for {self.names(src)}", src)

    def _front(self, pair: int) -> tuple[int, int] | None:
        """The (tag, bytes) of the message at the front of ``pair``'s ring, if its frame header is there."""
        tail = self._tail[pair]
        if int(self._heads[pair]) - tail < FRAME:
            return None
        start = tail % self.layout.capacity
        magic, tag, nbytes = self._ring(pair)[start:start + 24].view(torch.int64).tolist()
        if magic != _MAGIC:
            sender = self.names(self.layout.pairs[pair][0])
            raise CommunicationError(f"{self.me}: a shared-memory message from {sender} is corrupt (no frame header "
                                     "where one should be)")
        return tag, nbytes

    def _read_frame(self, src: int, nbytes: int, tensor: torch.Tensor, deadline: float) -> None:
        """The message at the front of the ring from ``src`` (its header already seen) into ``tensor``."""
        self._expect(tensor, nbytes, src)
        pair, cap = self._index[(src, self.rank)], self.layout.capacity
        ring = self._ring(pair)
        out = tensor.view(-1).view(torch.uint8) if tensor.is_contiguous() else torch.empty(nbytes, dtype=torch.uint8)
        tail, offset, end = self._tail[pair] + FRAME, 0, self._tail[pair] + FRAME + round_up(nbytes, FRAME)
        while tail < end:
            head = int(self._heads[pair])
            if head == tail:
                self._advance(pair, tail)
                self._sleep(int(self._bells[self.rank]), deadline, f"waiting for {self.names(src)}", src,
                            ready=lambda: int(self._heads[pair]) > tail)
                continue
            start = tail % cap
            n = min(head - tail, cap - start, end - tail)
            useful = max(0, min(n, nbytes - offset))
            if useful:
                out[offset:offset + useful].copy_(ring[start:start + useful])
            offset += useful
            tail += n
        self._advance(pair, tail)
        if not tensor.is_contiguous():
            tensor.copy_(out.view(tensor.dtype).view(tensor.shape))

    def _advance(self, pair: int, tail: int) -> None:
        if tail != self._tail[pair]:
            self._tail[pair] = tail
            self._tails[pair] = tail  # after the copy: the sender may write there again
            if self._use_futex:
                futex.wake(self._tails[pair].data_ptr())

    def _fill(self, tensor: torch.Tensor, kept: torch.Tensor, src: int) -> torch.Tensor:
        self._expect(tensor, kept.numel(), src)
        tensor.copy_(kept.view(tensor.dtype).view(tensor.shape))
        return tensor

    def _expect(self, tensor: torch.Tensor, nbytes: int, src: int) -> None:
        """A message of ``nbytes`` from ``src`` goes into ``tensor`` only if that is its size."""
        want = tensor.numel() * tensor.element_size()
        if want != nbytes:
            raise CommunicationError(f"{self.me}: expected {want} bytes from {self.names(src)}, got a message of "
                                     f"{nbytes}: the two sides disagree on the protocol")

    # -- waiting --------------------------------------------------------------------------------------

    def _sleep(self, bell: int, deadline: float, doing: str, peer: int | None, ready: Any = None) -> None:
        """Sleep until this rank's doorbell moves from ``bell`` (or ``ready()``), at most a slice; raises once the
        deadline passed, or if ``peer``'s process is gone."""
        now = time.monotonic()
        self._check(now, deadline, doing, peer if peer is not None and self._due(now) else None)
        if ready is not None and ready():
            return
        if self._use_futex:
            futex.wait(self._bells[self.rank].data_ptr(), bell, min(deadline - now, _SLICE_S))
        else:
            time.sleep(5e-5)

    def _due(self, now: float) -> bool:
        """Whether this thread's waits should check a peer's process now (every ``_LIVENESS_S``)."""
        if now - getattr(self._waits, "checked", 0.0) >= _LIVENESS_S:
            self._waits.checked = now
            return True
        return False

    def _check(self, now: float, deadline: float, doing: str, peer: int | None) -> None:
        if now >= deadline:
            raise CommunicationError(f"{self.me}: no answer within {self.timeout.total_seconds():g} s while {doing}; "
                                     "it died or hangs (raise --timeout if it is only slow)")
        if peer is not None and self.pids and not _alive(self.pids[peer]):
            raise CommunicationError(f"{self.me}: connection lost while {doing}; it exited or crashed")

    def _ring(self, pair: int) -> torch.Tensor:
        start = self.layout.counters_bytes + pair * self.layout.capacity
        return self._mapping[start:start + self.layout.capacity]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie, not yet reaped by its parent, has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")
