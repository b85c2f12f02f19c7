"""A parameter server rank's whole life: hold a partition, apply pushed gradients, answer pulls.

The server keeps its part of the parameters (see :mod:`.partition`) as one flat buffer; the optimizer that
``make_optimizer`` builds sees one 1-D ``nn.Parameter`` per piece, each a view of that buffer, and each
piece's gradient is a view of one flat gradient buffer that a push is received into. So a push costs one
receive, one optional scaling and one ``optimizer.step()``.

Protocol (all tensors, every receive bounded by the channel's timeout): a worker sends a request header
``[kind, worker, a, b, c, d]`` on ``TAG_REQUEST`` and, for init and push, the partition's values on
``TAG_REQUEST_DATA``; the server answers pull and read with ``[REPLY, server, version, updates, c, 0]`` and its
values (a pull's answer: c = the staleness of the worker's last applied gradient, -1 before its first). A pull
for step ``s`` is answered when the staleness policy allows; with bound 0 from a copy taken
when the version last advanced, so every slice of step ``s`` is computed on the same parameters.

* ticket ``[TICKET, w, step, 0, 0, 0]`` (server 0 only): the next slice of a step ``<= step`` and a pull for it
  in one: answered as a pull, with the ticket in the header's last value, or at once with a header alone whose
  ticket is -1 when every such slice is taken (the worker goes on to its next step). A worker sends its last
  slice's push just before, so one round trip serves a slice;
* init ``[INIT, w, start step, has state, 0, 0]``: the values, then (has state) the optimizer state as
  :class:`~.state.StateLayout` lays it out; a resumed run starts at ``start step``;
* push ``[PUSH, w, clock, read version, lr bits, ticket]``: the gradient, applied at the learning rate the
  worker's schedule gave for that step (a NaN: the optimizer's own); ticket -1: the worker's fixed slice;
* read, state and stats ``[KIND, w, step, 0, 0, 0]`` are answered once every slice of the steps before ``step``
  is applied (:meth:`ServerBook.caught_up`), so what the trainers save or evaluate at step ``step`` is the same
  whatever the arrival order: the values, the optimizer state (header b: 1 if it follows), or the update
  records (header a: how many rows of ``[worker, clock, ticket, read version, applied version, missed]``
  follow, b: duplicates ignored).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
from torch import nn

from polytrain.distributed.p2p import Channel, bits_float, header
from polytrain.errors import CommunicationError
from polytrain.strategies.ps.book import ServerBook
from polytrain.strategies.ps.layout import (DONE, INIT, KIND_NAMES, PULL, PUSH, READ, RECORD_WIDTH, REPLY, STATE,
                                            STATS, TAG_REPLY, TAG_REPLY_DATA, TAG_REQUEST, TAG_REQUEST_DATA, TICKET,
                                            Layout)
from polytrain.strategies.ps.partition import PartitionPlan
from polytrain.strategies.ps.staleness import StalenessPolicy
from polytrain.strategies.ps.state import StateLayout

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ParameterServer:
    def __init__(self, channel: Channel, layout: Layout, plan: PartitionPlan, policy: StalenessPolicy,
                 make_optimizer: MakeOptimizer, *, scale: float = 1.0, dtype: torch.dtype = torch.float32):
        self.channel = channel
        self.layout = layout
        self.plan = plan
        self.index = layout.server_index(channel.rank)
        self.scale = scale
        self.flat = torch.zeros(plan.numel(self.index), dtype=dtype)
        self.grad = torch.zeros_like(self.flat)
        self.params = [nn.Parameter(self.flat[p.offset:p.offset + p.numel]) for p in plan.pieces_of(self.index)]
        for param, piece in zip(self.params, plan.pieces_of(self.index)):
            param.grad = self.grad[piece.offset:piece.offset + piece.numel]
        self.optimizer = make_optimizer(self.params)
        self.state_layout = StateLayout.probe(make_optimizer, dtype)
        self.book = ServerBook(layout.worker_ranks, policy, layout.name)
        self._snapshot: torch.Tensor | None = None  # bound 0: what pulls get until the version advances
        self._waiting: list[tuple[int, int, int]] = []  # (kind, worker, step): reads until caught up
        self._tickets: dict[int, int] = {}  # worker -> the ticket its deferred pull answers
        #: bound 0: slices that came before an earlier one of their step, until it is applied
        self._held: dict[int, tuple[int, int, int, float, torch.Tensor]] = {}

    # -- the loop ---------------------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Receive the initial values from the first worker, then serve until every worker is done."""
        self._receive_init()
        while not self.book.all_done:
            silent = ", ".join(str(w) for w in self.book.silent())
            kind, worker, a, b, c, d = self.channel.recv_header_any(TAG_REQUEST, f"worker rank(s) {silent}")
            self._handle(kind, worker, a, b, c, d)
        return {"server": self.index, "rank": self.channel.rank, **self.book.summary()}

    def _receive_init(self) -> None:
        first = self.layout.worker_ranks[0]
        kind, worker, start, has_state, *_ = self.channel.recv_header(first, TAG_REQUEST)
        if kind != INIT or worker != first:
            raise CommunicationError(f"{self.channel.me}: expected the initial parameters from "
                                     f"{self.layout.name(first)}, got '{KIND_NAMES.get(kind, kind)}'")
        self._recv_values(self.flat, first)
        if has_state:
            sizes = self.state_layout.sizes(self.plan, self.index)
            keys = self.state_layout
            dtypes = [self.flat.dtype] * len(keys.tensors) + [torch.float64] * len(keys.scalars)
            flat = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
            self.channel.exchange(recvs=[(t, first, TAG_REQUEST_DATA) for t in flat if t.numel()])
            self.state_layout.unpack(self.optimizer, self.params, flat)
        self.book.start_at(start)
        self._take_snapshot()

    def _handle(self, kind: int, worker: int, a: int, b: int, c: int = 0, d: int = 0) -> None:
        before = self.book.version()
        if kind == PUSH:
            self._push(worker, clock=a, read_version=b, lr=bits_float(c), ticket=d)
        elif kind == TICKET:
            self._hand_ticket(worker, step=a)
        elif kind == PULL:
            if self.book.pull(worker, step=a):
                self._reply(worker, self._pulled())
        elif kind in (READ, STATE, STATS):
            self.book.known(worker)
            self._waiting.append((kind, worker, a))
        elif kind == DONE:
            self.book.finish(worker)
        else:
            raise CommunicationError(f"{self.channel.me}: unexpected message '{KIND_NAMES.get(kind, kind)}' "
                                     f"from rank {worker}")
        if self.book.version() != before:
            self._take_snapshot()
        for waiting, _ in self.book.ready():
            self._reply(waiting, self._pulled(), ticket=self._tickets.pop(waiting, -1))
        self._answer_caught_up()

    def _answer_caught_up(self) -> None:
        still = []
        for kind, worker, clock in self._waiting:
            if not self.book.caught_up(clock):
                still.append((kind, worker, clock))
            elif kind == READ:
                self._reply(worker, self.flat, read_only=True)
            elif kind == STATE:
                self._send_state(worker)
            else:
                self._send_records(worker)
        self._waiting = still

    # -- updates ----------------------------------------------------------------------------------------

    def _hand_ticket(self, worker: int, step: int) -> None:
        if self.index != 0:
            raise CommunicationError(f"{self.channel.me}: {self.layout.name(worker)} asked for a ticket; only "
                                     "the first parameter server hands them out")
        ticket = self.book.take_ticket(worker, step)
        if ticket is None:
            self.channel.exchange(sends=[(header(REPLY, self.channel.rank, self.book.version(), self.book.updates,
                                                 -1, -1), worker, TAG_REPLY)])
        elif self.book.pull(worker, ticket // self.layout.workers):
            self._reply(worker, self._pulled(), ticket=ticket)
        else:
            self._tickets[worker] = ticket  # goes with the deferred answer

    def _push(self, worker: int, clock: int, read_version: int, lr: float = math.nan, ticket: int = -1) -> None:
        ticket = self.book.admit(worker, clock, ticket)
        if ticket is None:
            self._recv_values(torch.empty_like(self.grad), worker)  # drained, not applied
            return
        self._recv_values(self.grad, worker)
        if self.book.policy.synchronous and ticket != self.book.tickets.finished:
            # bound 0: a step's slices are applied in slice order, whoever computed them and whenever they
            # came, so the run is the same every time (and a restart ends bit for bit as the first run would)
            self._held[ticket] = (worker, clock, read_version, lr, self.grad.clone())
            return
        self._apply(worker, clock, read_version, lr, ticket)
        while self.book.tickets.finished in self._held:
            ticket = self.book.tickets.finished
            worker, clock, read_version, lr, grad = self._held.pop(ticket)
            self.grad.copy_(grad)
            self._apply(worker, clock, read_version, lr, ticket)

    def _apply(self, worker: int, clock: int, read_version: int, lr: float, ticket: int) -> None:
        if self.scale != 1.0:
            self.grad.mul_(self.scale)
        if not math.isnan(lr):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.book.applied(worker, clock, read_version, ticket)

    def _pulled(self) -> torch.Tensor:
        """What a pull gets: with bound 0 the values as the version last advanced, else the latest."""
        return self._snapshot if self._snapshot is not None else self.flat

    def _take_snapshot(self) -> None:
        if self.book.policy.synchronous:
            self._snapshot = self.flat.clone()

    # -- wire -------------------------------------------------------------------------------------------

    def _reply(self, worker: int, values: torch.Tensor, read_only: bool = False, ticket: int = -1) -> None:
        version = self.book.version() if read_only else self.book.replied(worker)
        # a pull's answer also tells the worker the staleness of its last gradient (-1: none applied yet)
        stale = -1 if read_only else self.book.last_staleness.get(worker, -1)
        sends = [(header(REPLY, self.channel.rank, version, self.book.updates, stale, ticket), worker, TAG_REPLY)]
        if values.numel():
            sends.append((values, worker, TAG_REPLY_DATA))
        self.channel.exchange(sends=sends)

    def _send_state(self, worker: int) -> None:
        flat = self.state_layout.pack(self.optimizer, self.params)
        sends = [(header(REPLY, self.channel.rank, self.book.version(), self.book.updates, int(flat is not None)),
                  worker, TAG_REPLY)]
        sends += [(t, worker, TAG_REPLY_DATA) for t in flat or [] if t.numel()]
        self.channel.exchange(sends=sends)

    def _send_records(self, worker: int) -> None:
        rows = torch.tensor(self.book.rows(), dtype=torch.int64).reshape(-1, RECORD_WIDTH)
        sends = [(header(REPLY, self.channel.rank, len(rows), len(self.book.duplicates)), worker, TAG_REPLY)]
        if len(rows):
            sends.append((rows, worker, TAG_REPLY_DATA))
        self.channel.exchange(sends=sends)

    def _recv_values(self, into: torch.Tensor, worker: int) -> None:
        if into.numel():
            self.channel.recv(into, worker, TAG_REQUEST_DATA)

    # -- state ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """This server's values and optimizer state (pieces as in the plan), for checkpoints."""
        return {"index": self.index, "values": self.flat.clone(), "optimizer": self.optimizer.state_dict()}
