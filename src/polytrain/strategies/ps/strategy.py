"""``async``: asynchronous data parallel through parameter servers, with an optional staleness bound.

``--workers N --servers S`` starts N + S processes: ranks 0..N-1 train, ranks N.. are parameter servers
(:mod:`polytrain.strategies.ps`). The servers hold the parameters, cut across them by size, and the
optimizer state. Each global batch is cut into N slices; parameter server 0 hands the slices out as
*tickets*, in order, to whichever worker asks: every worker loops "take a ticket, pull the parameters,
compute the gradient of that slice, push it" until no slice of the current step is left, then goes on to
the next step. A fast worker so computes more slices than a slow one instead of waiting for it, and every
slice of every step is computed exactly once. A server applies each pushed gradient alone, once, scaled by
1/N, at the learning rate the schedule gives for its step. With ``--staleness K`` no slice of step c+K+1
starts before every slice of step c is applied (K = 0: bulk synchronous, equal to ``sync`` for plain SGD).

What ``--batch-size`` means: there is no global update, so it counts the examples of *one step*, as for
``sync``: N slices of ``batch / N`` examples, each pushed and applied alone, so that for plain SGD one step
moves the parameters as much as one ``sync`` step. ``--steps`` counts steps of ``batch`` examples over all
workers together, whoever computed them (a slow worker computes fewer slices).

Evaluation, checkpoints and the saved model read the servers at the step the trainers are at, once every
slice of the earlier steps is applied: what is saved at step ``s`` does not depend on arrival order. The
optimizer state travels between the servers' pieces and ``single``'s ``torch.optim`` layout
(:mod:`.state`), so a checkpoint of any strategy resumes here and the other way round.

``--tolerate-worker-loss``: workers 1..N-1 are *helpers* (role ``helper``): outside the trainer's loop, each
takes tickets of any step until none is left, drawing that step's batch itself. Worker 0 alone runs the
trainer's loop (it logs, evaluates the whole test set, checkpoints and saves; its own trainers' group has one
rank, so no collective ever waits for a helper). A helper that dies is reported by the launcher and the
heartbeat; parameter server 0 hands the slices it held out again (docs/async-ps.md), and before worker 0 reads
the servers it computes any such slice nobody else is left to. What is evaluated or saved at step ``s`` holds
every slice of the steps before ``s``, and possibly a few later ones the helpers pushed meanwhile.

Not supported yet: parameters of several dtypes; buffers (BatchNorm statistics) are each worker's own: the
saved model has trainer rank 0's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from polytrain.data.batches import Batch, Slice
from polytrain.distributed.layout import Layout
from polytrain.distributed.p2p import Channel
from polytrain.distributed.shm import ShmPlan
from polytrain.distributed.shm_channel import MailboxLayout, SharedMemoryChannel, gather_mailbox_plan
from polytrain.distributed.topology import Topology
from polytrain.errors import CommunicationError, ConfigError
from polytrain.precision import refuse_loss_scaling
from polytrain.strategies.base import OptimizerFactory, Strategy
from polytrain.strategies.registry import register_strategy
from polytrain.strategies.ps.capabilities import HelperLoop, ServerLoop, Tickets
from polytrain.strategies.ps.client import ParameterClient
from polytrain.strategies.ps.config import AsyncConfig, AsyncDeclared
from polytrain.strategies.ps.ranks import Ranks
from polytrain.strategies.ps.partition import PartitionPlan
from polytrain.strategies.ps.server import ParameterServer
from polytrain.strategies.ps.staleness import StalenessPolicy
from polytrain.strategies.ps.state import StateFormat
from polytrain.strategies.ps.stats import StalenessWindow, staleness_summary
from polytrain.strategies.step import RunSource, StepRecipe, StepResult, forward_backward


@register_strategy
class AsyncParameterServer(AsyncDeclared, Strategy):

    def __init__(self, topology: Topology, options: AsyncConfig | None = None, layout: Layout | None = None):
        if not topology.distributed:
            raise ConfigError("--strategy async needs its parameter server processes: run it through "
                              "polytrain train or polytrain.fit, which start --workers + --servers processes")
        super().__init__(topology, options, layout)
        self.ranks = Ranks(self.layout.processes - self.options.servers, self.options.servers)
        if topology.backend == "gloo":
            wire = topology.group
        else:  # every rank takes part in creating the group (new_group is collective over the world)
            wire = dist.new_group(list(range(topology.world_size)), timeout=topology.timeout, backend="gloo")
        self.channel = Channel(wire, topology.timeout, self.ranks.name, me=self.ranks.name(topology.rank))
        self.source: RunSource | None = None  # any step's batch and LR (out_of_order.bind)
        self.policy = StalenessPolicy(self.options.staleness)
        self.clock = 0  # this worker's next push (its own count; tells a retried push from a new one)
        self.step = 0  # the trainers' next step: every trainer is at the same one at log/eval/checkpoint points
        self._connected = False
        self._initial_state: dict[str, Any] | None = None  # a resumed optimizer state, sent with the values
        self._read_at = -1  # the clock the model's values were last read from the servers at
        self._lr: float | None = None
        self._waited = 0.0
        self._window = StalenessWindow()
        self._ahead: int | None = None  # a slice of the trainers' next step, taken before it began
        self._ahead_loaded = False  # whether the model holds the values pulled for it
        self._global_batch = 0
        self.tolerant = bool(self.options.tolerate_worker_loss) and self.ranks.workers > 1
        #: --overlap: the next slice is pulled while this one computes, its push goes behind (refused with
        #: staleness 0 and --tolerate-worker-loss before launch: AsyncDeclared.layout)
        self._overlap = bool(self.options.overlap) and not self.policy.synchronous and not self.tolerant
        self._slices = 0  # slices this worker computed
        self._comm_plan: ShmPlan | None = None  # how gradients and values travel (prepare decides)
        self._role = self.layout.role(topology.rank)
        if self._role != "server":
            self.out_of_order = Tickets(self)  # every worker draws whole batches; its tickets say which slice

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        super().check(layout, config, model)
        refuse_loss_scaling(config, cls.name, "the parameter servers apply each worker's gradient alone, so no "
                                              "step can be skipped for every worker at once")

    def describe(self) -> str:
        n, s = self.ranks.workers, self.ranks.servers
        text = (f"async: {n} worker(s) ({_ranks(0, n)}) + {s} parameter server(s) ({_ranks(n, n + s)}), "
                f"{self.policy.describe()}; {self.plan.total:,} parameters cut over the servers")
        if self._comm_plan is not None:
            text += f", gradients and values through {_through(self._comm_plan)}"
        if self._overlap:
            text += ("\n  --overlap: each slice's parameters are pulled while the slice before computes, and its "
                     "gradient is pushed without waiting (about one slice staler)")
        if self.tolerant:
            text += (f"\n  --tolerate-worker-loss: {_ranks(1, n)} may be lost (their slices go to the others); "
                     "worker 0 logs its own slices' loss and evaluates alone")
        if self._global_batch:
            text += (f"\n  --batch-size {self._global_batch} counts one step: {n} slices of {self._global_batch // n} "
                     f"examples, handed to whichever worker is free, each applied alone at lr/{n}")
        return text

    # -- model, servers and clients -------------------------------------------------------------------

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, recipe: StepRecipe | None = None,
                place: Callable[[nn.Module], None] | None = None) -> nn.Module:
        self.recipe = recipe or StepRecipe()
        self.amp = self._precision_runtime()  # bf16-mixed: autocast in each slice's forward (_gradient)
        model = self._materialize(model)
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        if len(dtypes) > 1:
            raise ConfigError(f"--strategy async: the model's parameters have several dtypes ({', '.join(dtypes)}); "
                              "parameter servers keep one dtype: convert the model to one")
        dtype = next(model.parameters()).dtype
        self.plan = PartitionPlan.for_model(model.named_parameters(), self.ranks.servers)
        self.state_format = StateFormat.probe(make_optimizer, dtype)
        self._open_mailboxes(dtype)
        if self._role == "server":
            self.model = model  # the server's values live in its flat buffer; this copy only names them
            self.server = self._build_server(make_optimizer, dtype)
            self.optimizer = self.server.optimizer
            self.own_loop = ServerLoop(self.server)
            return model
        if self._role == "helper":
            self.own_loop = HelperLoop(self)
        self.model = model.to(self.topology.device)
        if place is not None:
            place(self.model)
        # never stepped: it gives a checkpoint single's param_groups and its lr follows the schedule
        self.optimizer = make_optimizer(self.model.parameters())
        self.client = ParameterClient(self.channel, self.ranks, self.plan, self.model)
        return self.model

    def _open_mailboxes(self, dtype: torch.dtype) -> None:
        """Gradients and values through shared memory where ``--ps-comm`` allows it and every rank can map it
        (a collective over every rank, servers included)."""
        if self.options.ps_comm == "backend":
            self._comm_plan = ShmPlan(False, "--ps-comm backend")
            return
        pairs = [p for w in self.ranks.worker_ranks for s in self.ranks.server_ranks for p in ((w, s), (s, w))]
        pairs += [(a, b) for a in self.ranks.server_ranks for b in self.ranks.server_ranks if a != b]
        largest = max(self.plan.numel(s) for s in range(self.ranks.servers)) * dtype.itemsize
        layout = MailboxLayout.for_messages(self.topology.world_size, pairs, largest)
        self._comm_plan = gather_mailbox_plan(self.topology, layout)
        if not self._comm_plan.use:
            if self.options.ps_comm == "shm":
                raise ConfigError(f"--ps-comm shm cannot be used: {self._comm_plan.reason}; pass --ps-comm backend "
                                  "or auto")
            return
        self.channel = SharedMemoryChannel.open(self.channel, self.topology, layout)

    def _build_server(self, make_optimizer: OptimizerFactory, dtype: torch.dtype) -> ParameterServer:
        """This server rank's :class:`ParameterServer` (a test subclass makes one that fails on purpose)."""
        return ParameterServer(self.channel, self.ranks, self.plan, self.policy, make_optimizer,
                               scale=1.0 / self.ranks.workers, dtype=dtype, lost=self.topology.lost)

    def _help(self) -> dict[str, Any]:
        """A helper's loop: slices of any step, until every slice of the run is handed out."""
        assert self.source is not None, "the trainer binds the run's source before the helper's loop"
        last, pushed = self.source.total_steps - 1, None
        while (ticket := self._next_slice(last, pushed)) is not None:
            pushed = self._compute(ticket)
        self.client.done()
        return {"role": "helper", "rank": self.topology.rank, "slices": self._slices}

    def _connect(self) -> None:
        """Trainer rank 0, before anyone's first step: the servers get the (resumed) values and optimizer
        state. Done lazily, after any ``load_state_dict``; the other workers' first pulls wait for it."""
        if self._connected:
            return
        self._connected = True
        if self.topology.rank == self.ranks.worker_ranks[0]:
            state = None
            if self._initial_state is not None:
                state = self.state_format.from_single(self.plan, self._initial_state.get("state", {}),
                                                      dict(self.model.named_parameters()))
            self.client.send_initial(self.step, state)
            self._initial_state = None

    # -- the step -------------------------------------------------------------------------------------

    def _set_lr(self, lr: float) -> None:
        self._lr = lr  # travels with this step's push: the servers apply the schedule of the step it is for
        super()._set_lr(lr)

    def train_step(self, batch: Batch, lr: float) -> StepResult:
        """Every slice of ``batch`` (a whole global batch) that this worker gets a ticket for, one by one.

        Each request (carrying the last slice's push) asks for a slice of this step or the next, so a worker
        that finds this step's slices all taken gets its next one in the same round trip; a slice of the next
        step is kept for the next call, its values already pulled (pulled again if a read replaced them)."""
        assert self.model is not None, "call prepare() first"
        self._set_lr(lr)
        self._connect()
        n, step, losses, examples = self.ranks.workers, batch.step, [], 0
        ticket, self._ahead = self._ahead, None
        if ticket is not None and not self._ahead_loaded:
            self._pull(step)  # evaluation or a checkpoint read the servers since the ticket came
        if ticket is None:
            ticket = self._next_slice(step + 1, None)
        while ticket is not None and ticket // n <= step:  # earlier: one a lost worker held (tolerant)
            if self._overlap:  # the next slice and its values come while this one computes
                self.client.prefetch(step + 1)
            if ticket // n == step:
                piece = self._slice(batch, ticket)
                losses.append(self._gradient(piece))
                examples += len(piece)
                pushed = (self.clock, self._lr, ticket)
                self.clock += 1
            else:
                pushed = self._compute(ticket)
            if self._overlap:  # the push goes before the wait: a bounded answer may wait for it
                self._counted(self.client.push_behind, *pushed)
                ticket = self._next_slice(step + 1, None, fetched=True)
            else:
                ticket = self._next_slice(step + 1, pushed)  # carries this slice's push
        if ticket is not None and ticket // n != step + 1:
            raise CommunicationError(f"{self.ranks.name(self.topology.rank)} got slice {ticket} of step "
                                     f"{ticket // n} while at step {step}: the workers' steps disagree")
        self._ahead, self._ahead_loaded = ticket, ticket is not None
        self.step = step + 1
        self.traffic.examples += examples
        # a slice's loss is its share of the step's (as sync's slices); their mean estimates the step's
        loss = torch.stack(losses).mean() if losses else None
        return StepResult(loss, examples, self._take_wait())

    def _slice(self, batch: Batch, ticket: int) -> Batch:
        part = Slice(ticket % self.ranks.workers, self.ranks.workers)
        return replace(batch, inputs=part.take(batch.inputs), targets=part.take(batch.targets))

    def _compute(self, ticket: int) -> tuple[int, float, int]:
        """The gradient of slice ``ticket`` of any step, from that step's batch; returns its push (clock, lr,
        ticket). A helper's slices, or an earlier step's slice that a lost worker held."""
        step = ticket // self.ranks.workers
        started = time.perf_counter()
        self._gradient(self._slice(self.source.batch_at(step), ticket))
        self.traffic.examples += self._global_batch // self.ranks.workers
        self.source.after_slice(time.perf_counter() - started, step)
        pushed = (self.clock, float(self.source.lr_at(step)), ticket)
        self.clock += 1
        return pushed

    def _pull(self, step: int) -> None:
        self._counted(self.client.pull, step)

    def _next_slice(self, step: int, pushed: tuple[int, float | None, int] | None,
                    wait: bool = False, fetched: bool = False) -> int | None:
        """The next slice (its values loaded), asked for now or (``fetched``) by the prefetch."""
        ticket = self._counted(self.client.fetched) if fetched else self._counted(self.client.next_slice, step,
                                                                                   pushed, wait)
        if ticket is not None:
            self._window.add(self.client.last_staleness)
            self._slices += 1
        return ticket

    def _counted(self, call: Callable[..., Any], *args: Any) -> Any:
        """``call(*args)`` on the client, its seconds counted as waiting and its bytes as traffic."""
        started, sent, received = time.perf_counter(), self.client.bytes_sent, self.client.bytes_received
        try:
            return call(*args)
        finally:
            self._waited += time.perf_counter() - started
            self.traffic.add(self.client.bytes_sent - sent, self.client.bytes_received - received)

    def _gradient(self, batch: Batch) -> torch.Tensor:
        """This slice's gradient in the model's ``.grad`` (pushed with the next request); returns its loss."""
        self.model.zero_grad(set_to_none=True)
        recipe = self.recipe
        # the replicas' gradients are summed by the servers at 1/N each, as sync averages them
        loss = forward_backward(self.model, batch, recipe.task, self.ranks.workers, recipe.accumulate,
                                lambda model, enabled: contextlib.nullcontext(), self._backward, loss=recipe.loss,
                                amp=self.amp)
        if recipe.clip_grad_norm is not None:  # no global gradient here: each push is clipped alone
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), recipe.clip_grad_norm)
        return loss

    def _refresh(self) -> None:
        """The servers' values at this trainer's step into the model (for evaluation and saving)."""
        self._connect()
        if self._read_at != self.step:
            if self.tolerant and self.step > 0:
                self._mop_up(self.step)
            self.client.read(self.step)
            self._read_at = self.step
            self._ahead_loaded = False  # the values pulled for a kept slice are replaced

    def _mop_up(self, step: int) -> None:
        """Worker 0, before it reads the values at ``step``: compute the slices of earlier steps that lost
        workers held, until every slice before ``step`` is applied (it may be the only worker left)."""
        pushed = None
        with _training(self.model):  # called from evaluation, which runs in eval mode without autograd
            while (ticket := self._next_slice(step - 1, pushed, wait=True)) is not None:
                pushed = self._compute(ticket)
        self._ahead_loaded = False  # the values pulled for a kept slice were replaced

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        self._refresh()
        return super().eval_step(inputs, targets)

    def finish(self) -> None:
        self._connect()
        self.client.done()

    # -- metrics ----------------------------------------------------------------------------------------

    def _take_wait(self) -> float:
        waited, self._waited = self._waited, 0.0
        return waited

    def take_metrics(self) -> dict[str, float]:
        return {**super().take_metrics(), **self._window.take()}

    def summary_metrics(self) -> dict[str, Any]:
        out = super().summary_metrics()
        if self.trainers.is_main:
            self._connect()
            records = self.client.records(self.step)
            out.update(staleness_summary(records.rows, records.duplicates, self.policy.bound))
            if self.tolerant:
                out.update(workers=self.ranks.workers, workers_lost=sorted(records.lost),
                           slices_skipped=records.skipped)
        return out

    # -- the whole model's state ----------------------------------------------------------------------

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        """The servers' values at the trainers' step (and their optimizer state in single's layout), on the
        trainers' rank 0."""
        if not self.trainers.is_main:
            return None
        self._refresh()
        model = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if not optimizer:
            return {"model": model}
        per_server = self.client.optimizer_state(self.step, self.state_format)
        whole = self.optimizer.state_dict()  # single's param_groups (never stepped: no state of its own)
        whole["state"] = self.state_format.to_single(self.plan, per_server, dict(self.model.named_parameters()))
        return {"model": model, "optimizer": whole}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._role == "server":
            return  # the servers get the values and optimizer state from trainer rank 0 (_connect)
        self.model.load_state_dict(state["model"])
        self.clock = self.step = int(state.get("step", 0))
        self._initial_state = state["optimizer"] if self.topology.rank == self.ranks.worker_ranks[0] else None


@contextlib.contextmanager
def _training(model: nn.Module) -> Iterator[None]:
    """Autograd on and ``model`` in training mode, as in a step, whatever the caller had; restored after."""
    was_training = model.training
    model.train()
    try:
        with torch.enable_grad():
            yield
    finally:
        model.train(was_training)


def _ranks(first: int, stop: int) -> str:
    return f"rank {first}" if stop - first == 1 else f"ranks {first}-{stop - 1}"


def _through(plan: ShmPlan) -> str:
    return "shared memory" if plan.use else f"gloo messages ({plan.reason})"
