"""A parameter server rank's whole life: hold a partition, apply pushed gradients, answer pulls.

The server keeps its part of the parameters (see :mod:`.partition`) as one flat buffer; the optimizer that
``make_optimizer`` builds sees one 1-D ``nn.Parameter`` per piece, each a view of that buffer, and each
piece's gradient is a view of one flat gradient buffer that a push is received into. So a push costs one
receive, one optional scaling and one ``optimizer.step()``.

Protocol (all tensors, every receive bounded by the channel's timeout): a worker sends a request header
``[kind, worker, a, b, c]`` on ``TAG_REQUEST`` and, for init and push, the partition's values on
``TAG_REQUEST_DATA``; the server answers pull and read with ``[REPLY, server, version, updates, 0]`` and its
values (a pull's answer: c = the staleness of the worker's last applied gradient, -1 before its first). A pull
for clock ``c`` is answered when the staleness policy allows; with bound 0 from a copy taken
when the global clock last advanced, so every worker computes step ``c`` on the same parameters.

* init ``[INIT, w, start clock, has state, 0]``: the values, then (has state) the optimizer state as
  :class:`~.state.StateLayout` lays it out; a resumed run starts every worker's clock at ``start clock``;
* push ``[PUSH, w, clock, read version, lr bits]``: the gradient, applied at the learning rate the worker's
  schedule gave for that step (a NaN: the optimizer's own);
* read, state and stats ``[KIND, w, clock, 0, 0]`` are answered once every worker has finished the steps
  before ``clock`` (:meth:`ServerBook.caught_up`), so what the trainers save or evaluate at step ``clock`` is
  the same whatever the arrival order: the values, the optimizer state (header b: 1 if it follows), or the
  update records (header a: how many rows of ``[worker, clock, read version, applied version, missed]``
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
from polytrain.strategies.ps.layout import (DONE, INIT, KIND_NAMES, PULL, PUSH, READ, REPLY, STATE, STATS,
                                            TAG_REPLY, TAG_REPLY_DATA, TAG_REQUEST, TAG_REQUEST_DATA, Layout)
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
        self._snapshot: torch.Tensor | None = None  # bound 0: what pulls of the current global clock get
        self._waiting: list[tuple[int, int, int]] = []  # (kind, worker, clock): reads until caught up

    # -- the loop ---------------------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Receive the initial values from the first worker, then serve until every worker is done."""
        self._receive_init()
        while not self.book.all_done:
            silent = ", ".join(str(w) for w in self.book.silent())
            kind, worker, a, b, c = self.channel.recv_header_any(TAG_REQUEST, f"worker rank(s) {silent}")
            self._handle(kind, worker, a, b, c)
        return {"server": self.index, "rank": self.channel.rank, **self.book.summary()}

    def _receive_init(self) -> None:
        first = self.layout.worker_ranks[0]
        kind, worker, start, has_state, _ = self.channel.recv_header(first, TAG_REQUEST)
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

    def _handle(self, kind: int, worker: int, a: int, b: int, c: int = 0) -> None:
        before = self.book.version()
        if kind == PUSH:
            self._push(worker, clock=a, read_version=b, lr=bits_float(c))
        elif kind == PULL:
            if self.book.pull(worker, clock=a):
                self._reply(worker, self._snapshot if self._snapshot is not None else self.flat)
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
            self._reply(waiting, self._snapshot if self._snapshot is not None else self.flat)
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

    def _push(self, worker: int, clock: int, read_version: int, lr: float = math.nan) -> None:
        if not self.book.admit(worker, clock):
            self._recv_values(torch.empty_like(self.grad), worker)  # drained, not applied
            return
        self._recv_values(self.grad, worker)
        if self.scale != 1.0:
            self.grad.mul_(self.scale)
        if not math.isnan(lr):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.book.applied(worker, clock, read_version)

    def _take_snapshot(self) -> None:
        if self.book.policy.synchronous:
            self._snapshot = self.flat.clone()

    # -- wire -------------------------------------------------------------------------------------------

    def _reply(self, worker: int, values: torch.Tensor, read_only: bool = False) -> None:
        version = self.book.version() if read_only else self.book.replied(worker)
        # a pull's answer also tells the worker the staleness of its last gradient (-1: none applied yet)
        stale = -1 if read_only else self.book.last_staleness.get(worker, -1)
        sends = [(header(REPLY, self.channel.rank, version, self.book.updates, stale), worker, TAG_REPLY)]
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
        rows = torch.tensor(self.book.summary()["records"], dtype=torch.int64).reshape(-1, 5)
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
