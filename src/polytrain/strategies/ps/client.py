"""A worker's side of the parameter servers: pull the parameters into the local model, push gradients.

Values travel through CPU buffers (one per server, laid out by the plan), so the model may live on a GPU
while gloo carries the bytes. Each call talks to every server at once: headers to all, then values.
"""

from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from polytrain.distributed.p2p import HEADER_LEN, Channel, float_bits, header
from polytrain.phases import phase
from polytrain.errors import CommunicationError
from polytrain.strategies.ps.ranks import (DONE, DROPPED, INIT, PULL, PUSH, READ, RECORD_WIDTH, REPLY, STATE,
                                            STATS, TAG_REPLY, TAG_REPLY_DATA, TAG_REQUEST, TAG_REQUEST_DATA, TICKET,
                                            Ranks)
from polytrain.strategies.ps.partition import PartitionPlan
from polytrain.strategies.ps.state import StateFormat


@dataclass
class Records:
    """What the servers recorded: each server's update rows ``[worker, clock, ticket, read version, applied
    version, missed]``, the duplicate pushes they ignored, the workers lost, and the slices skipped (pushed by a
    lost worker to the first server only: left out of another server's part)."""

    rows: list[torch.Tensor] = field(default_factory=list)
    duplicates: int = 0
    lost: set[int] = field(default_factory=set)
    skipped: int = 0


class ParameterClient:
    def __init__(self, channel: Channel, ranks: Ranks, plan: PartitionPlan, model: nn.Module):
        self.channel = channel
        self.ranks = ranks
        self.plan = plan
        self.params: dict[str, nn.Parameter] = dict(model.named_parameters())
        dtype = next(iter(self.params.values())).dtype
        self.buffers = [torch.empty(plan.numel(s), dtype=dtype) for s in range(plan.servers)]
        self.versions = [0] * plan.servers  # per server: the version (steps applied) of the values last pulled
        self.updates = [0] * plan.servers  # per server: updates applied when they were pulled
        #: the staleness of this worker's last applied gradient, the most of any server (-1: not known yet)
        self.last_staleness = -1
        self.bytes_sent = self.bytes_received = 0  # every tensor this client sent or received, headers included
        self.incoming: list[torch.Tensor] = []  # a prefetched slice's values (allocated by the first prefetch)
        self._fetching: _Background | None = None  # the prefetch on its way
        self._in_flight: list = []  # the push on its way (posted, not waited for)

    # -- calls ------------------------------------------------------------------------------------------

    def send_initial(self, start_clock: int = 0, state: Sequence[Sequence[torch.Tensor]] | None = None) -> None:
        """First worker only, before anyone's first pull: the model's values become the servers' values, and
        ``state`` (each server's optimizer state, as :meth:`StateFormat.from_single` cuts it) their optimizer
        state; training starts at step ``start_clock`` (every worker's first push is clock ``start_clock``)."""
        self.settle()
        me, sends = self.channel.rank, []
        values = self._values(self.params)
        for s, rank in enumerate(self.ranks.server_ranks):
            sends.append((header(INIT, me, start_clock, int(state is not None)), rank, TAG_REQUEST))
            parts = [values[s]] + list(state[s] if state is not None else [])
            sends += [(t, rank, TAG_REQUEST_DATA) for t in parts if t.numel()]
        self._exchange(sends=sends)

    def next_slice(self, step: int, done: tuple[int, float | None, int] | None = None,
                   wait: bool = False) -> int | None:
        """Push the gradient of the slice just computed (``done``: its clock, lr and ticket), take the next
        slice of a step ``<= step`` from server 0 and pull the values to compute it, all in one round trip
        (and one more to the other servers, if any). Returns the slice's ticket (global step ``t // N``, slice
        ``t % N``), or None when every slice up to ``step`` is taken (then nothing is loaded). ``wait``: None
        only once every slice up to ``step`` is applied; until then, wait for a lost worker's slice to compute."""
        self.settle()
        sends = self._push_messages(*done) if done is not None else []
        taken = self._take_slice(step, wait, sends, self.buffers, self._count)
        return self._load(taken, self.buffers)

    def prefetch(self, step: int) -> None:
        """Start taking the next slice of a step ``<= step`` and pulling its values, in the background, while
        the caller computes (its values go to a buffer of their own, loaded by :meth:`fetched`). The push of
        the slice being computed may follow (:meth:`push_behind`): the servers may hold the answer until it
        is applied (staleness bound), so nothing here waits for the answer."""
        assert self._fetching is None, "take the slice prefetched before asking for another"
        counted = [0, 0]  # bytes sent and received by the thread, added to the client's by fetched()

        def count(sent: int, received: int) -> None:
            counted[0] += sent
            counted[1] += received

        def fetch() -> tuple[tuple[int, list[int], list[int], int] | None, list[int]]:
            return self._take_slice(step, False, [], self.incoming, count, label=False), counted

        if not self.incoming:
            self.incoming = [torch.empty_like(b) for b in self.buffers]
        self._fetching = _Background(fetch, f"{self.channel.me}: prefetch of the next slice")

    def fetched(self) -> int | None:
        """The slice :meth:`prefetch` asked for: its values into the model; its ticket (None: none left)."""
        fetching, self._fetching = self._fetching, None
        with phase("exchange"):
            taken, counted = fetching.result(self.channel.timeout.total_seconds() + 5.0)
        self._count(*counted)
        return self._load(taken, self.incoming)

    def push_behind(self, clock: int, lr: float | None = None, ticket: int = -1) -> None:
        """Post the push of slice ``ticket`` and return: it completes in the background, the next call that
        talks to the servers waits for it first (one push in flight)."""
        self.settle()
        sends = self._push_messages(clock, lr, ticket)
        self._count(sum(t.numel() * t.element_size() for t, _, _ in sends), 0)
        with phase("exchange"):
            self._in_flight = self.channel.post(sends=sends)

    def settle(self) -> None:
        """Wait for the push in flight, if any (bounded by the channel's timeout)."""
        posted, self._in_flight = self._in_flight, []
        if posted:
            with phase("exchange"):
                self.channel.complete(posted)

    def _take_slice(self, step: int, wait: bool, sends: list, buffers: list[torch.Tensor],
                    count: Callable[[int, int], None], label: bool = True
                    ) -> tuple[int, list[int], list[int], int] | None:
        """Ask server 0 for a ticket (after ``sends``) and receive its values into ``buffers`` (the other
        servers' too): (ticket, versions, updates, staleness), or None when no slice is left."""
        first = self.ranks.server_ranks[0]
        sends = [*sends, (header(TICKET, self.channel.rank, step, int(wait)), first, TAG_REQUEST)]
        head = torch.empty(HEADER_LEN, dtype=torch.int64)
        self._exchange(sends=sends, recvs=[(head, first, TAG_REPLY)], count=count, label=label)
        _, version, updates, stale, ticket = self._check_reply(head, first)
        if ticket == DROPPED:
            raise CommunicationError(f"{self.channel.me}: the parameter servers count this worker as lost (it was "
                                     "silent longer than --heartbeat-timeout) and gave its slices to the others")
        if ticket < 0:
            return None
        # the values follow the header; a deferred answer (staleness bound) comes whole, later
        recvs = [(buffers[0], first, TAG_REPLY_DATA)] if buffers[0].numel() else []
        self._exchange(recvs=recvs, count=count, label=label)
        versions, counts, stales = [version], [updates], [stale]
        rest = self.ranks.server_ranks[1:]
        if rest:  # the other servers' parts, for this ticket: every request and receive posted at once
            heads = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in rest]
            recvs = []
            for s, (head, rank) in enumerate(zip(heads, rest), start=1):
                recvs.append((head, rank, TAG_REPLY))
                if buffers[s].numel():
                    recvs.append((buffers[s], rank, TAG_REPLY_DATA))
            pulls = [(header(PULL, self.channel.rank, ticket // self.ranks.workers, 0, 0, ticket), rank, TAG_REQUEST)
                     for rank in rest]
            self._exchange(sends=pulls, recvs=recvs, count=count, label=label)
            for head, rank in zip(heads, rest):
                _, version, updates, stale, _ = self._check_reply(head, rank)
                versions.append(version)
                counts.append(updates)
                stales.append(stale)
        return ticket, versions, counts, max(stales)

    def _load(self, taken: tuple[int, list[int], list[int], int] | None, buffers: list[torch.Tensor]) -> int | None:
        """A slice's values from ``buffers`` into the model; its ticket (None: no slice, nothing loaded)."""
        if taken is None:
            return None
        ticket, self.versions, self.updates, self.last_staleness = taken
        for s in range(self.plan.servers):
            self.plan.unflatten(buffers[s], s, self.params)
        return ticket

    def pull(self, step: int) -> list[int]:
        """Wait until every server lets this worker start a slice of ``step``; load the values into the
        model. Returns each server's version (steps applied) of the values."""
        self.settle()
        return self._ask(PULL, step)

    def push(self, clock: int, lr: float | None = None, ticket: int = -1) -> None:
        """Send this worker's gradients of its push number ``clock`` (missing gradients count as zero), for
        slice ``ticket`` (-1: the worker's fixed slice of step ``clock``), to be applied at learning rate ``lr``
        (None: the servers' optimizer's own)."""
        self.settle()
        self._exchange(sends=self._push_messages(clock, lr, ticket))

    def read(self, step: int = 0) -> list[int]:
        """The servers' values into the model once every slice of the steps before ``step`` is applied
        (0: at once), for saving or evaluating."""
        self.settle()
        return self._ask(READ, step)

    def optimizer_state(self, step: int, state_format: StateFormat) -> list[list[torch.Tensor] | None]:
        """Each server's optimizer state (None: none yet) once every slice of the steps before ``step`` is applied."""
        self.settle()
        heads = self._post_request(STATE, step)
        out: list[list[torch.Tensor] | None] = []
        for s, rank in enumerate(self.ranks.server_ranks):
            if not self._check_reply(heads[s], rank)[3]:
                out.append(None)
                continue
            dtypes = [self.buffers[s].dtype] * len(state_format.tensors) + [torch.float64] * len(state_format.scalars)
            flat = [torch.empty(n, dtype=d) for n, d in zip(state_format.sizes(self.plan, s), dtypes)]
            self._exchange(recvs=[(t, rank, TAG_REPLY_DATA) for t in flat if t.numel()])
            out.append(flat)
        return out

    def records(self, step: int) -> Records:
        """Every server's update records once the steps before ``step`` are applied."""
        self.settle()
        heads = self._post_request(STATS, step)
        out = Records()
        for s, rank in enumerate(self.ranks.server_ranks):
            count, dup, lost, skipped = self._check_reply(heads[s], rank)[1:5]
            parts = [torch.empty(count, RECORD_WIDTH, dtype=torch.int64), torch.empty(lost, dtype=torch.int64),
                     torch.empty(skipped, dtype=torch.int64)]
            self._exchange(recvs=[(t, rank, TAG_REPLY_DATA) for t in parts if t.numel()])
            out.rows.append(parts[0])
            out.duplicates += dup
            out.lost.update(parts[1].tolist())
            out.skipped += len(parts[2])
        return out

    def done(self) -> None:
        """This worker will send nothing more; a server ends once every worker said so."""
        self.settle()
        self._send(DONE, None)

    # -- helpers ----------------------------------------------------------------------------------------

    def _values(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        cpu = {name: t.detach().to("cpu") for name, t in tensors.items()}
        return [self.plan.flatten(cpu, s, out=self.buffers[s]) for s in range(self.plan.servers)]

    def _push_messages(self, clock: int, lr: float | None, ticket: int) -> list:
        grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in self.params.items()}
        return self._messages(PUSH, self._values(grads), clock, float_bits(math.nan if lr is None else lr), ticket)

    def _send(self, kind: int, values: list[torch.Tensor] | None, clock: int = 0) -> None:
        """A header (and values) to every server, all posted at once."""
        self._exchange(sends=self._messages(kind, values, clock))

    def _messages(self, kind: int, values: list[torch.Tensor] | None, clock: int = 0, extra: int = 0,
                  ticket: int = -1) -> list:
        me = self.channel.rank
        sends = []
        for s, rank in enumerate(self.ranks.server_ranks):
            sends.append((header(kind, me, clock, self.versions[s], extra, ticket), rank, TAG_REQUEST))
            if values is not None and values[s].numel():
                sends.append((values[s], rank, TAG_REQUEST_DATA))
        return sends

    def _ask(self, kind: int, clock: int, ranks: Sequence[int] | None = None, ticket: int = -1) -> list[int]:
        """Post the answers' receives first, then ask (every server, or ``ranks``; a pull says for which
        ``ticket``): no server ever waits for us to listen."""
        ranks = list(self.ranks.server_ranks if ranks is None else ranks)
        indices = [self.ranks.server_index(rank) for rank in ranks]
        heads = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in ranks]
        recvs = []
        for head, s, rank in zip(heads, indices, ranks):
            recvs.append((head, rank, TAG_REPLY))
            if self.buffers[s].numel():
                recvs.append((self.buffers[s], rank, TAG_REPLY_DATA))
        sends = [(header(kind, self.channel.rank, clock, 0, 0, ticket), rank, TAG_REQUEST) for rank in ranks]
        self._exchange(sends=sends, recvs=recvs)
        stale = []
        for head, s, rank in zip(heads, indices, ranks):
            _, version, updates, stale_s, _ = self._check_reply(head, rank)
            self.versions[s], self.updates[s] = version, updates
            stale.append(stale_s)
            self.plan.unflatten(self.buffers[s], s, self.params)
        if kind == PULL:
            self.last_staleness = max(stale)
        return list(self.versions)

    def _exchange(self, sends: Sequence = (), recvs: Sequence = (), count: Callable[[int, int], None] | None = None,
                  label: bool = True) -> None:
        """``label`` False: on the prefetch thread (the step's phases are the training thread's)."""
        (count or self._count)(sum(t.numel() * t.element_size() for t, _, _ in sends),
                               sum(t.numel() * t.element_size() for t, _, _ in recvs))
        with phase("exchange") if label else contextlib.nullcontext():
            self.channel.exchange(sends=sends, recvs=recvs)

    def _count(self, sent: int, received: int) -> None:
        self.bytes_sent += sent
        self.bytes_received += received

    def _post_request(self, kind: int, clock: int) -> list[torch.Tensor]:
        """Ask every server; the reply headers (what follows them differs by server: read separately)."""
        heads = [torch.empty(HEADER_LEN, dtype=torch.int64) for _ in self.ranks.server_ranks]
        self._exchange(sends=[(header(kind, self.channel.rank, clock), rank, TAG_REQUEST)
                                     for rank in self.ranks.server_ranks],
                              recvs=[(heads[s], rank, TAG_REPLY) for s, rank in enumerate(self.ranks.server_ranks)])
        return heads

    def _check_reply(self, head: torch.Tensor, rank: int) -> list[int]:
        """The header's values after the kind: [sender, a, b, c, d]; raises if it is no reply."""
        answer, *rest = head.tolist()
        if answer != REPLY:
            raise CommunicationError(f"{self.channel.me}: {self.ranks.name(rank)} answered with message "
                                     f"kind {answer} instead of a reply")
        return rest


class _Background:
    """``call()`` on a daemon thread of its own (a process that ends on an error does not wait for it);
    :meth:`result` joins it within a timeout and raises what it raised."""

    def __init__(self, call: Callable[[], Any], doing: str):
        self.doing = doing
        self._outcome: list[Any] = []  # [True, result] or [False, exception]
        self._thread = threading.Thread(target=self._run, args=(call,), name="polytrain-ps-prefetch", daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._outcome[:] = [True, call()]
        except BaseException as exc:  # raised on the training thread by result()
            self._outcome[:] = [False, exc]

    def result(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise CommunicationError(f"{self.doing} did not end within {timeout:g} s")
        ok, value = self._outcome
        if not ok:
            raise value
        return value
