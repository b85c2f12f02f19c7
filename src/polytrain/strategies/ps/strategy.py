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
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from polytrain.data.batches import Batch, Shard
from polytrain.distributed.p2p import Channel
from polytrain.distributed.topology import Topology
from polytrain.errors import CommunicationError, ConfigError
from polytrain.options import option, register_section
from polytrain.strategies.base import OptimizerFactory, Strategy, register_strategy
from polytrain.strategies.ps.client import ParameterClient
from polytrain.strategies.ps.layout import Layout
from polytrain.strategies.ps.partition import PartitionPlan
from polytrain.strategies.ps.server import ParameterServer
from polytrain.strategies.ps.staleness import StalenessPolicy
from polytrain.strategies.ps.state import StateLayout
from polytrain.strategies.ps.stats import StalenessWindow, staleness_summary
from polytrain.strategies.step import StepRecipe, StepResult, forward_backward


@register_section("async", "strategy async (parameter servers)", order=71)
@dataclass
class AsyncConfig:
    servers: int = option(1, "async: parameter server processes, started besides the --workers (ranks after "
                             "theirs). --batch-size counts one step: N slices of batch/N examples, each computed "
                             "by whichever worker is free and applied alone, scaled by 1/N; --steps counts "
                             "such steps over all workers", minimum=1, metavar="S")
    staleness: int | None = option(None, "async: no worker starts step c+K+1 before every worker finished step c "
                                         "(0: bulk synchronous; leave out for fully asynchronous)", minimum=0,
                                   metavar="K")
    tolerate_worker_loss: bool = option(False, "async: go on without workers 1..N-1 if they die (their slices "
                                               "go to the others); worker 0 alone logs, evaluates and saves, and "
                                               "the servers must live")


@register_strategy
class AsyncParameterServer(Strategy):
    name = "async"
    summary = "asynchronous data parallel: parameter servers apply each worker's gradient as it arrives"
    multiprocess = True
    config_section = "async"

    def __init__(self, topology: Topology, options: AsyncConfig | None = None):
        super().__init__(topology, options)
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
        self.tolerant = bool(self.options.tolerate_worker_loss) and self.layout.workers > 1
        self._slices = 0  # slices this worker computed

    # -- layout ---------------------------------------------------------------------------------------

    @classmethod
    def processes(cls, workers: int, options: Any = None) -> int:
        return workers + cls.options_or_defaults(options).servers

    @classmethod
    def data_slices(cls, workers: int, options: Any = None) -> int:
        return workers

    @classmethod
    def expendable_ranks(cls, workers: int, options: Any = None) -> list[int]:
        return list(range(1, workers)) if cls.options_or_defaults(options).tolerate_worker_loss else []

    @classmethod
    def rank_names(cls, workers: int, options: Any = None) -> list[str]:
        layout = Layout(workers, cls.options_or_defaults(options).servers)
        return [layout.name(rank) for rank in range(layout.world_size)]

    @classmethod
    def check(cls, workers: int, global_batch: int, accumulate: int, options: Any = None) -> None:
        opts = cls.options_or_defaults(options)
        Layout(workers, opts.servers)
        cls.check_batch(workers, global_batch, accumulate)

    def arrange(self, topology: Topology) -> Topology:
        servers = self.options.servers
        if not topology.distributed:
            raise ConfigError("--strategy async needs its parameter server processes: run it through "
                              "polytrain train or polytrain.fit, which start --workers + --servers processes")
        self.layout = Layout(topology.world_size - servers, servers)
        # every rank takes part in creating each group (new_group is collective over the world)
        group = dist.new_group(self.layout.worker_ranks, timeout=topology.timeout)
        wire = topology.group if topology.backend == "gloo" else \
            dist.new_group(list(range(topology.world_size)), timeout=topology.timeout, backend="gloo")
        rank = topology.rank
        self.channel = Channel(wire, topology.timeout, self.layout.name, me=self.layout.name(rank))
        if self.options.tolerate_worker_loss:
            # no collective may wait for a worker that can die: each worker is a trainers' group of its own
            # (worker 0 evaluates every test example; a helper reads the checkpoint it resumes from itself)
            self._trainers = replace(topology, rank=0, world_size=1, group=None)
        elif self.layout.role(rank) == "trainer":
            self._trainers = replace(topology, world_size=self.layout.workers, group=group)
        else:  # a server builds the same session (data slice 0) but never reduces metrics with the trainers
            self._trainers = replace(topology, rank=0, world_size=self.layout.workers, group=None)
        return topology

    @property
    def role(self) -> str:
        role = self.layout.role(self.topology.rank)
        return "helper" if role == "trainer" and self.topology.rank > 0 and self.tolerant else role

    @property
    def trainers(self) -> Topology:
        return self._trainers

    def batch_slices(self) -> int:
        # every worker's trainers' group may be its own (--tolerate-worker-loss): a step is still N slices
        return self.layout.workers

    def step_shards(self, global_batch: int, accumulate: int, data_workers: int = 0,
                    deterministic: bool = False) -> Shard | Callable[[int], Shard]:
        self._global_batch = global_batch  # for describe(): what one push holds
        return Shard(0, 1)  # every worker draws whole global batches: which slice it computes comes with its ticket

    def describe(self) -> str:
        n, s = self.layout.workers, self.layout.servers
        text = (f"async: {n} worker(s) ({_ranks(0, n)}) + {s} parameter server(s) ({_ranks(n, n + s)}), "
                f"{self.policy.describe()}; {self.plan.total:,} parameters cut over the servers")
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
        dtypes = sorted({str(p.dtype) for p in model.parameters()})
        if len(dtypes) > 1:
            raise ConfigError(f"--strategy async: the model's parameters have several dtypes ({', '.join(dtypes)}); "
                              "parameter servers keep one dtype: convert the model to one")
        dtype = next(model.parameters()).dtype
        self.plan = PartitionPlan.for_model(model.named_parameters(), self.layout.servers)
        self.state_layout = StateLayout.probe(make_optimizer, dtype)
        if self.role == "server":
            self.model = model  # the server's values live in its flat buffer; this copy only names them
            self.server = self.build_server(make_optimizer, dtype)
            self.optimizer = self.server.optimizer
            return model
        self.model = model.to(self.topology.device)
        if place is not None:
            place(self.model)
        # never stepped: it gives a checkpoint single's param_groups and its lr follows the schedule
        self.optimizer = make_optimizer(self.model.parameters())
        self.client = ParameterClient(self.channel, self.layout, self.plan, self.model)
        return self.model

    def build_server(self, make_optimizer: OptimizerFactory, dtype: torch.dtype) -> ParameterServer:
        """This server rank's :class:`ParameterServer` (a test subclass makes one that fails on purpose)."""
        return ParameterServer(self.channel, self.layout, self.plan, self.policy, make_optimizer,
                               scale=1.0 / self.layout.workers, dtype=dtype, lost=self.topology.lost)

    def serve(self) -> dict[str, Any]:
        if self.role == "helper":
            return self._help()
        return {"role": "server", **self.server.serve()}

    def _help(self) -> dict[str, Any]:
        """A helper's loop: slices of any step, until every slice of the run is handed out."""
        assert self.source is not None, "the trainer binds the run's source before serve()"
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
        if self.topology.rank == self.layout.worker_ranks[0]:
            state = None
            if self._initial_state is not None:
                state = self.state_layout.from_single(self.plan, self._initial_state.get("state", {}),
                                                      dict(self.model.named_parameters()))
            self.client.send_initial(self.step, state)
            self._initial_state = None

    # -- the step -------------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        self._lr = lr  # travels with this step's push: the servers apply the schedule of the step it is for
        super().set_lr(lr)

    def train_step(self, batch: Batch) -> StepResult:
        """Every slice of ``batch`` (a whole global batch) that this worker gets a ticket for, one by one.

        Each request (carrying the last slice's push) asks for a slice of this step or the next, so a worker
        that finds this step's slices all taken gets its next one in the same round trip; a slice of the next
        step is kept for the next call, its values already pulled (pulled again if a read replaced them)."""
        assert self.model is not None, "call prepare() first"
        self._connect()
        n, step, losses, examples = self.layout.workers, batch.step, [], 0
        ticket, self._ahead = self._ahead, None
        if ticket is not None and not self._ahead_loaded:
            self._pull(step)  # evaluation or a checkpoint read the servers since the ticket came
        if ticket is None:
            ticket = self._next_slice(step + 1, None)
        while ticket is not None and ticket // n <= step:  # earlier: one a lost worker held (tolerant)
            if ticket // n == step:
                piece = self._slice(batch, ticket)
                losses.append(self._gradient(piece))
                examples += len(piece)
                pushed = (self.clock, self._lr, ticket)
                self.clock += 1
            else:
                pushed = self._compute(ticket)
            ticket = self._next_slice(step + 1, pushed)  # carries this slice's push
        if ticket is not None and ticket // n != step + 1:
            raise CommunicationError(f"{self.layout.name(self.topology.rank)} got slice {ticket} of step "
                                     f"{ticket // n} while at step {step}: the workers' steps disagree")
        self._ahead, self._ahead_loaded = ticket, ticket is not None
        self.step = step + 1
        self.traffic.examples += examples
        # a slice's loss is its share of the step's (as sync's slices); their mean estimates the step's
        loss = torch.stack(losses).mean() if losses else None
        return StepResult(loss, examples)

    def _slice(self, batch: Batch, ticket: int) -> Batch:
        part = Shard(ticket % self.layout.workers, self.layout.workers)
        return replace(batch, inputs=part.take(batch.inputs), targets=part.take(batch.targets))

    def _compute(self, ticket: int) -> tuple[int, float, int]:
        """The gradient of slice ``ticket`` of any step, from that step's batch; returns its push (clock, lr,
        ticket). A helper's slices, or an earlier step's slice that a lost worker held."""
        step = ticket // self.layout.workers
        started = time.perf_counter()
        self._gradient(self._slice(self.source.batch_at(step), ticket))
        self.traffic.examples += self._global_batch // self.layout.workers
        self.source.after_slice(time.perf_counter() - started, step)
        pushed = (self.clock, float(self.source.lr_at(step)), ticket)
        self.clock += 1
        return pushed

    def _pull(self, step: int) -> None:
        self._counted(self.client.pull, step)

    def _next_slice(self, step: int, pushed: tuple[int, float | None, int] | None,
                    wait: bool = False) -> int | None:
        ticket = self._counted(self.client.next_slice, step, pushed, wait)
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
        extra = {"loss": recipe.loss} if hasattr(recipe, "loss") else {}  # --loss, where the step supports it
        loss = forward_backward(self.model, batch, recipe.task, self.layout.workers, recipe.accumulate,
                                lambda model, enabled: contextlib.nullcontext(), self.backward, **extra)
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

    def syncs_at(self, step: int) -> bool:
        return False  # the workers meet only at the trainer's log points

    def take_wait_seconds(self) -> float:
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
                out.update(workers=self.layout.workers, workers_lost=sorted(records.lost),
                           slices_skipped=records.skipped)
        return out

    # -- the whole model's state ----------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        if not self.trainers.is_main:
            return None
        self._refresh()
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any] | None:
        model = self.model_state_dict()
        if model is None:
            return None
        per_server = self.client.optimizer_state(self.step, self.state_layout)
        optimizer = self.optimizer.state_dict()  # single's param_groups (never stepped: no state of its own)
        optimizer["state"] = self.state_layout.to_single(self.plan, per_server, dict(self.model.named_parameters()))
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.role == "server":
            return  # the servers get the values and optimizer state from trainer rank 0 (_connect)
        self.model.load_state_dict(state["model"])
        self.clock = self.step = int(state.get("step", 0))
        self._initial_state = state["optimizer"] if self.topology.rank == self.layout.worker_ranks[0] else None


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
