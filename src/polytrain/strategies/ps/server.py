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

* ticket ``[TICKET, w, step, wait, 0, 0]`` (server 0 only): the next slice of a step ``<= step`` and a pull for
  it in one: answered as a pull, with the ticket in the header's last value, or at once with a header alone whose
  ticket is -1 when every such slice is taken (the worker goes on to its next step). A worker sends its last
  slice's push just before, so one round trip serves a slice. ``wait`` 1: instead of -1, wait until a lost
  worker's slice comes back (then hand it) or every slice up to ``step`` is applied (then -1);
* pull ``[PULL, w, step, 0, 0, ticket]`` (the servers after the first, for the slice server 0 handed);
* init ``[INIT, w, start step, has state, 0, 0]``: the values, then (has state) the optimizer state as
  :class:`~.state.StateFormat` lays it out; a resumed run starts at ``start step``;
* push ``[PUSH, w, clock, read version, lr bits, ticket]``: the gradient, applied at the learning rate the
  worker's schedule gave for that step (a NaN: the optimizer's own); ticket -1: the worker's fixed slice;
* read, state and stats ``[KIND, w, step, 0, 0, 0]`` are answered once every slice of the steps before ``step``
  is applied (:meth:`ServerBook.caught_up`), so what the trainers save or evaluate at step ``step`` is the same
  whatever the arrival order: the values, the optimizer state (header b: 1 if it follows), or the update
  records (header a: how many rows of ``[worker, clock, ticket, read version, applied version, missed]``
  follow, b: duplicates ignored, c: lost workers, d: slices skipped; their ranks and tickets follow the rows).

With ``--tolerate-worker-loss`` workers 1..N-1 may be lost. The first server learns of it from the heartbeat
(:class:`~.inbox.WatchedInbox`) or from a failed send or receive; the slices the worker held and had not
pushed to it go out again (first, and instead of a later slice a waiting pull holds), and it tells the other
servers ``[LOST, server 0, w, n, 0, 0]`` with the n requeued tickets: each of them counts what the lost worker
pulled for, did not push there and will not be computed again (it reached server 0) as applied without an update
(``skipped``). A ticket request from a worker counted as lost is answered ``DROPPED``.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from polytrain.distributed.p2p import Channel, bits_float, header
from polytrain.errors import CommunicationError
from polytrain.log import EVERY_RANK, get_logger
from polytrain.strategies.ps.book import ServerBook
from polytrain.strategies.ps.inbox import Inbox, WatchedInbox
from polytrain.strategies.ps.ranks import (DONE, DROPPED, INIT, KIND_NAMES, LOST, PULL, PUSH, READ, RECORD_WIDTH,
                                            REPLY, STATE, STATS, TAG_REPLY, TAG_REPLY_DATA, TAG_REQUEST,
                                            TAG_REQUEST_DATA, TICKET, Ranks)
from polytrain.strategies.ps.partition import PartitionPlan
from polytrain.strategies.ps.staleness import StalenessPolicy
from polytrain.strategies.ps.state import StateFormat

if TYPE_CHECKING:
    from polytrain.distributed.lost import LostRanks

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class ParameterServer:
    def __init__(self, channel: Channel, ranks: Ranks, plan: PartitionPlan, policy: StalenessPolicy,
                 make_optimizer: MakeOptimizer, *, scale: float = 1.0, dtype: torch.dtype = torch.float32,
                 lost: LostRanks | None = None):
        self.channel = channel
        self.ranks = ranks
        self.plan = plan
        self.index = ranks.server_index(channel.rank)
        self.scale = scale
        self.flat = torch.zeros(plan.numel(self.index), dtype=dtype)
        self.grad = torch.zeros_like(self.flat)
        self.params = [nn.Parameter(self.flat[p.offset:p.offset + p.numel]) for p in plan.pieces_of(self.index)]
        for param, piece in zip(self.params, plan.pieces_of(self.index)):
            param.grad = self.grad[piece.offset:piece.offset + piece.numel]
        self.optimizer = make_optimizer(self.params)
        self.state_format = StateFormat.probe(make_optimizer, dtype)
        #: workers the job goes on without (--tolerate-worker-loss); the first server learns of their loss
        self.lost = lost if lost is not None and lost.expendable else None
        self.book = ServerBook(ranks.worker_ranks, policy, ranks.name, tolerant=self.lost is not None)
        self._mopping: dict[int, int] = {}  # worker -> step: a ticket request that waits for a requeued slice
        self._snapshot: torch.Tensor | None = None  # bound 0: what pulls get until the version advances
        self._waiting: list[tuple[int, int, int]] = []  # (kind, worker, step): reads until caught up
        self._tickets: dict[int, int] = {}  # worker -> the ticket its deferred pull answers
        #: bound 0: slices that came before an earlier one of their step, until it is applied
        self._held: dict[int, tuple[int, int, int, float, torch.Tensor]] = {}

    # -- the loop ---------------------------------------------------------------------------------------

    def serve(self) -> dict[str, Any]:
        """Receive the initial values from the first worker, then serve until every worker is done (or lost)."""
        self._receive_init()
        inbox = self._inbox()
        while not self.book.all_done:
            event = inbox.next()
            before = self.book.version()
            if event.lost is not None:
                self._lose(event.lost, event.reason)
            else:
                self._handle(*event.header)
            self._answer_waiting(before)
        return {"server": self.index, "rank": self.channel.rank, **self.book.summary()}

    def _inbox(self) -> Inbox:
        def expected() -> str:
            return f"worker rank(s) {', '.join(str(w) for w in self.book.silent())}"

        if self.lost is None or self.index != 0:
            return Inbox(self.channel, TAG_REQUEST, expected)
        # only the first server watches the heartbeat: it requeues the lost worker's slices and tells the others
        return WatchedInbox(self.channel, TAG_REQUEST, expected, self.lost)

    def _receive_init(self) -> None:
        first = self.ranks.worker_ranks[0]
        kind, worker, start, has_state, *_ = self.channel.recv_header(first, TAG_REQUEST)
        if kind != INIT or worker != first:
            raise CommunicationError(f"{self.channel.me}: expected the initial parameters from "
                                     f"{self.ranks.name(first)}, got '{KIND_NAMES.get(kind, kind)}'")
        self._recv_values(self.flat, first)
        if has_state:
            sizes = self.state_format.sizes(self.plan, self.index)
            keys = self.state_format
            dtypes = [self.flat.dtype] * len(keys.tensors) + [torch.float64] * len(keys.scalars)
            flat = [torch.empty(n, dtype=d) for n, d in zip(sizes, dtypes)]
            self.channel.exchange(recvs=[(t, first, TAG_REQUEST_DATA) for t in flat if t.numel()])
            self.state_format.unpack(self.optimizer, self.params, flat)
        self.book.start_at(start)
        self._take_snapshot()

    def _handle(self, kind: int, worker: int, a: int, b: int, c: int = 0, d: int = 0) -> None:
        if kind == LOST and self.lost is not None and worker == self.ranks.server_ranks[0]:
            self._abandon(lost=a, count=b)
        elif worker in self.book.lost:
            self._from_lost(kind, worker)
        elif kind == PUSH:
            self._push(worker, clock=a, read_version=b, lr=bits_float(c), ticket=d)
        elif kind == TICKET:
            self._hand_ticket(worker, step=a, wait=bool(b))
        elif kind == PULL:
            if d >= 0:
                self.book.announce(worker, d)
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

    def _answer_waiting(self, before: int) -> None:
        """After each event: answer what waited for it (pulls the staleness bound held, a slice handed back
        by a lost worker, reads waiting for a step's last slice)."""
        if self.book.version() != before:
            self._take_snapshot()
        for worker, ticket in list(self._tickets.items()):
            earlier = self.book.swap(worker, ticket)
            if earlier is not None:
                self._tickets[worker] = earlier
        for waiting, _ in self.book.ready():
            self._reply(waiting, self._pulled(), ticket=self._tickets.pop(waiting, -1))
        for worker, step in list(self._mopping.items()):
            if worker in self.book.lost:
                del self._mopping[worker]
            elif self.book.tickets.requeued or self.book.caught_up(step + 1):
                del self._mopping[worker]
                self._hand_ticket(worker, step, wait=True)
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

    def _hand_ticket(self, worker: int, step: int, wait: bool = False) -> None:
        """The next slice of a step ``<= step`` for ``worker``, with the values to compute it; -1 when there is
        none. ``wait``: rather than -1, wait until a lost worker's slice comes back or every slice up to
        ``step`` is applied (the first worker before it reads the values: it may be the only one left)."""
        if self.index != 0:
            raise CommunicationError(f"{self.channel.me}: {self.ranks.name(worker)} asked for a ticket; only "
                                     "the first parameter server hands them out")
        ticket = self.book.take_ticket(worker, step)
        if ticket is None and wait and not self.book.caught_up(step + 1):
            self._mopping[worker] = step
        elif ticket is None:
            self._answer_ticket(worker, -1)
        elif self.book.pull(worker, ticket // self.ranks.workers):
            self._reply(worker, self._pulled(), ticket=ticket)
        else:
            self._tickets[worker] = ticket  # goes with the deferred answer

    def _answer_ticket(self, worker: int, ticket: int) -> None:
        """A ticket request's answer without values: -1 (nothing left up to its step) or DROPPED."""
        self._send(worker, [(header(REPLY, self.channel.rank, self.book.version(), self.book.updates, -1, ticket),
                             worker, TAG_REPLY)])

    # -- lost workers (--tolerate-worker-loss) ----------------------------------------------------------

    def _lose(self, worker: int, reason: str) -> None:
        """First server: ``worker`` is gone. Its slices go out again, and the other servers learn which."""
        if worker in self.book.lost:
            return
        back = self.book.lose(worker)
        self._tickets.pop(worker, None)
        self._mopping.pop(worker, None)
        get_logger().warning(f"{self.channel.me}: {self.ranks.name(worker)} lost ({reason}); "
                             f"{len(back)} slice(s) it held go to the other workers", extra=EVERY_RANK)
        for rank in self.ranks.server_ranks[1:]:
            sends = [(header(LOST, self.channel.rank, worker, len(back)), rank, TAG_REQUEST)]
            if back:
                sends.append((torch.tensor(back, dtype=torch.int64), rank, TAG_REQUEST_DATA))
            self.channel.exchange(sends=sends)

    def _abandon(self, lost: int, count: int) -> None:
        """Another server: the first one says worker ``lost`` is gone and handed ``count`` slices out again."""
        back = torch.empty(count, dtype=torch.int64)
        if count:
            self.channel.recv(back, self.ranks.server_ranks[0], TAG_REQUEST_DATA)
        self.book.abandon(lost, back.tolist())
        self._tickets.pop(lost, None)
        self._apply_held()

    def _from_lost(self, kind: int, worker: int) -> None:
        """A message a lost worker sent before it was lost (or one counted lost that is alive after all)."""
        if kind == PUSH:
            with contextlib.suppress(CommunicationError):  # its values, if they came; not applied
                self.channel.recv(torch.empty_like(self.grad), worker, TAG_REQUEST_DATA)
        elif kind == TICKET:
            self._answer_ticket(worker, DROPPED)  # it was silent too long: it ends, naming why

    def _send(self, worker: int, sends: list) -> bool:
        """Send to ``worker``; False when it is gone and may be (then it counts as lost)."""
        return self._talk(worker, sends=sends)

    def _talk(self, worker: int, sends: Sequence = (), recvs: Sequence = ()) -> bool:
        try:
            self.channel.exchange(sends=sends, recvs=recvs)
            return True
        except CommunicationError as exc:
            if self.lost is None or worker not in self.lost.expendable:
                raise
            if self.index == 0:
                self._lose(worker, str(exc))
            return False

    def _push(self, worker: int, clock: int, read_version: int, lr: float = math.nan, ticket: int = -1) -> None:
        admitted = self.book.admit(worker, clock, ticket)
        if not self._recv_values(self.grad if admitted is not None else torch.empty_like(self.grad), worker):
            return  # the worker was lost while sending: its slice goes out again
        if admitted is None:
            return  # a duplicate: drained, not applied
        ticket = admitted
        self.book.received(worker, ticket)
        if self.book.policy.synchronous and ticket != self.book.tickets.finished:
            # bound 0: a step's slices are applied in slice order, whoever computed them and whenever they
            # came, so the run is the same every time (and a restart ends bit for bit as the first run would)
            self._held[ticket] = (worker, clock, read_version, lr, self.grad.clone())
            return
        self._apply(worker, clock, read_version, lr, ticket)
        self._apply_held()

    def _apply_held(self) -> None:
        """Bound 0: the held slices that are next in order now."""
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
        self._send(worker, sends)

    def _send_state(self, worker: int) -> None:
        flat = self.state_format.pack(self.optimizer, self.params)
        sends = [(header(REPLY, self.channel.rank, self.book.version(), self.book.updates, int(flat is not None)),
                  worker, TAG_REPLY)]
        sends += [(t, worker, TAG_REPLY_DATA) for t in flat or [] if t.numel()]
        self.channel.exchange(sends=sends)

    def _send_records(self, worker: int) -> None:
        """Header [REPLY, server, rows, duplicates, lost workers, slices skipped], then the rows, then the lost
        workers' ranks and the skipped slices (each only if any)."""
        book = self.book
        rows = torch.tensor(book.rows(), dtype=torch.int64).reshape(-1, RECORD_WIDTH)
        sends = [(header(REPLY, self.channel.rank, len(rows), len(book.duplicates), len(book.lost), len(book.skipped)),
                  worker, TAG_REPLY)]
        for part in (rows, torch.tensor(book.lost, dtype=torch.int64), torch.tensor(book.skipped, dtype=torch.int64)):
            if part.numel():
                sends.append((part, worker, TAG_REPLY_DATA))
        self.channel.exchange(sends=sends)

    def _recv_values(self, into: torch.Tensor, worker: int) -> bool:
        return self._talk(worker, recvs=[(into, worker, TAG_REQUEST_DATA)]) if into.numel() else True

    # -- state ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """This server's values and optimizer state (pieces as in the plan), for checkpoints."""
        return {"index": self.index, "values": self.flat.clone(), "optimizer": self.optimizer.state_dict()}
