"""The Strategy protocol: the members every strategy has (``tests/strategies/test_protocol.py`` counts them), and
capabilities some have.

A strategy owns everything that differs between ways of training one model over processes and devices.

* Before anything starts: :meth:`Strategy.layout` (how many processes, their roles and names, the mesh axes
  of the trainer ranks, the slices of a global batch: :class:`~polytrain.distributed.layout.Layout`) and
  :meth:`Strategy.check` (settings and model that cannot work, as one ``ConfigError`` line).
* In every process: :meth:`prepare` (the model moved, wrapped or cut, and the optimizer over what this rank
  updates), :meth:`train_step` (micro-batches, forward, backward, exchange, update), :meth:`eval_step`,
  :meth:`state_dict`/:meth:`load_state_dict` (the whole model and optimizer as ``single`` saves them,
  loadable by any strategy), :meth:`local_state` (this rank's own, without a collective), :meth:`finish`,
  :meth:`describe`, :meth:`take_metrics`/:meth:`summary_metrics` (numbers of its own for the step records and
  the summary) and :attr:`module` (the plain model).

What only some strategies do is a *capability*: an object attribute, ``None`` where unsupported, which the
trainer asks for instead of asking which strategy it has or what role a rank plays:

* :attr:`own_loop`: this rank runs a loop of its own instead of the trainer's (a parameter server, an async
  helper): ``own_loop.run(source)``;
* :attr:`out_of_order`: this rank computes slices of any step, handed out at run time (async's tickets): it
  draws whole global batches, and ``out_of_order.bind(source)`` gives it the batch and LR of any step;
* :attr:`rebalancing`: the slices of each global batch are sized by the workers' measured speed
  (``sync --balance``): ``rebalancing.slices(...)`` gives the slice of each step;
* :attr:`sharded_state`: this rank holds a shard of the model and its optimizer state (``fsdp``): each rank
  writes its own part of a checkpoint, nothing gathered (``sharded_state.part()``).
* :attr:`held_state`: what this rank holds of the model and optimizer (a whole replica, or ``DTensor`` shards)
  is the run's state itself, its optimizer a ``torch.optim`` one over the model's parameters in ``single``'s
  order (``single``, ``sync``, ``fsdp``, ``tp``): a resume reads into it only the rows this rank holds
  (``held_state.load(checkpoint)``, :mod:`polytrain.strategies.held`; ``held_state.by_rows`` False: rank 0 reads
  and hands the state on, as ``sync`` does), and ``--save-model DIR`` is written from it
  one tensor at a time (:mod:`polytrain.weights.save`).
* :attr:`healing`: under ``--on-failure continue``, a lost rank's shards are taken from a replica peer and the
  strategy is built again around the whole state (``fsdp --dp-replicate 2``): ``healing.piece(local_state)``
  (this rank's rows, with its shard index) and ``healing.module(whole)`` (the plain model holding it), used by
  :mod:`polytrain.train.heal`.

The base class is the single-process, data-parallel-ready behaviour; ``single`` is it unchanged and ``sync``
overrides the exchange (the protected hooks ``_wrap``, ``_grad_sync``, ``_backward``, ``_optimizer_step``).
Strategies are chosen by name (``--strategy sync``) or as ``package.module:Class``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ClassVar, ContextManager, Iterable, Protocol

import torch
from torch import nn

from polytrain.data.batches import Batch, Slice
from polytrain.distributed.layout import Layout
from polytrain.distributed.topology import Topology, arrange
from polytrain.errors import ConfigError
from polytrain.models.deferred import materialize_all
from polytrain.options import section_defaults
from polytrain.phases import phase
from polytrain.precision import Amp
from polytrain.strategies.declared import one_process
from polytrain.strategies.step import RunSource, StepRecipe, StepResult, forward_backward
from polytrain.strategies.traffic import Traffic
from polytrain.strategies.traits import Traits

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
_NOTHING = contextlib.nullcontext()  # (one, reused: a step's contexts allocate nothing)


class OwnLoop(Protocol):
    """A rank that runs its own loop instead of the trainer's (a server, a helper)."""

    def run(self, source: RunSource) -> dict[str, Any]:
        """The rank's whole loop; returns its summary."""


class OutOfOrder(Protocol):
    """A rank whose work is handed out at run time, any step's: it draws whole global batches."""

    def bind(self, source: RunSource) -> None:
        """Any step's batch and learning rate, before the first step."""


class ShardedState(Protocol):
    """A rank that holds a shard of the model and optimizer state: a checkpoint is written in parts, each rank
    its own, with nothing gathered (:mod:`polytrain.train.sharded`)."""

    def part(self) -> dict[str, Any]:
        """This rank's pieces: ``{"model": {name: [offset, rows]}, "optimizer": {index: {key: ...}}}``."""

    def skeleton(self) -> dict[str, Any]:
        """The model's signature (whole shapes) and the optimizer's ``param_groups``, as single's would be."""


class HeldState(Protocol):
    """What this rank holds is the run's state itself: a checkpoint is read into it, each rank its rows."""

    by_rows: bool  # whether --resume reads on every rank (each its rows) rather than on rank 0 for all

    def load(self, checkpoint: Any) -> None:
        """Fill the model and optimizer from a :class:`~polytrain.train.lazy.LazyCheckpoint`, reading only what
        this rank holds."""


class Healing(Protocol):
    """This rank's shards, healed from a replica peer when a rank is lost (:mod:`polytrain.train.heal`)."""

    def piece(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's rows of ``state`` (its :meth:`Strategy.local_state`), copied, with its shard index."""

    def module(self, whole: dict[str, Any]) -> nn.Module:
        """The plain model as it came to ``prepare``, holding the model tensors of the whole state ``whole``."""


class Rebalancing(Protocol):
    """Slices of each global batch sized by the workers' measured speed."""

    def slices(self, global_batch: int, accumulate: int, data_workers: int,
               deterministic: bool) -> Slice | Callable[[int], Slice]:
        """This rank's slice of every step (fixed, or a function of the step), after ``prepare``."""


class Strategy:
    """Base class with the single-process behaviour; subclasses override what differs."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: the RunConfig section holding this strategy's own options (registered with ``register_section``)
    config_section: ClassVar[str] = ""
    #: what the strategy is, declared once (:class:`~polytrain.strategies.traits.Traits`): how its replicas meet,
    #: the degrees it takes and fills, the ``--precision`` modes it carries out itself (it reads
    #: ``recipe.precision`` in :meth:`prepare`; every other mode the base class runs), what a lost worker means
    traits: ClassVar[Traits] = Traits()

    def __init__(self, topology: Topology, options: Any = None, layout: Layout | None = None):
        self.options = options if options is not None else section_defaults(self.config_section)
        self.layout = layout if layout is not None else layout_for(type(self), topology.world_size, self.options)
        if topology.world_size != self.layout.processes:
            raise ConfigError(f"--strategy {self.name} lays out {self.layout.processes} process(es); this job has "
                              f"{topology.world_size}")
        #: this rank on the layout's mesh, and the trainer ranks as a topology of their own: metrics,
        #: evaluation and the NaN guard are reduced over it, and its rank 0 logs and writes checkpoints
        self.topology, self.trainers = arrange(topology, self.layout)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.recipe = StepRecipe()
        #: this rank's bytes sent and received in the exchange, and examples trained on (for bytes per example)
        self.traffic = Traffic()
        #: this rank's ``--precision`` at run time (autocast, loss scaler, skipped steps); set by :meth:`prepare`
        self.amp = Amp(device=self.topology.device)
        #: labels a part of the step in the per-operator placement log (the trainer's device runtime sets it)
        self.phase: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext()
        self.own_loop: OwnLoop | None = None
        self.out_of_order: OutOfOrder | None = None
        self.rebalancing: Rebalancing | None = None
        self.sharded_state: ShardedState | None = None
        self.held_state: HeldState | None = None
        self.healing: Healing | None = None

    # -- before anything starts ------------------------------------------------------------------------

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        """The job's layout for ``--workers`` (None: not given). By default one process, which no degree cuts."""
        return one_process(cls, options)

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        """Settings (and the model: the user's module, or None when it is named in the config) that cannot
        work: one ConfigError line, before any process starts. By default: the global batch cuts into the
        layout's slices of ``--accumulate`` equal micro-batches."""
        check_batch(layout.slices, config.global_batch(layout.slices), config.train.accumulate)

    # -- the model and its step ------------------------------------------------------------------------

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, recipe: StepRecipe | None = None,
                place: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """Take ``model`` (built alike on every rank), move and wrap it, let ``place`` put its sub-modules
        where the user asked, and build the optimizer over what this rank updates. Returns this rank's model. A
        model built on the meta device is materialised first (:mod:`polytrain.models.deferred`)."""
        self.recipe = recipe or StepRecipe()  # before _wrap: a strategy may carry out its precision there
        self.model = self._wrap(self._materialize(model))
        if place is not None:
            place(self.model)
        self.optimizer = make_optimizer(self.model.parameters())
        self.amp = self._precision_runtime()
        return self.model

    @property
    def module(self) -> nn.Module:
        """The plain model under any wrapper (DDP) this rank trains."""
        assert self.model is not None, "call prepare() first"
        return self._unwrap(self.model)

    def train_step(self, batch: Batch, lr: float) -> StepResult:
        """One optimizer step at learning rate ``lr`` on this rank's slice: forward, backward, exchange, update."""
        assert self.model is not None and self.optimizer is not None, "call prepare() first"
        with phase("update"):
            self._set_lr(lr)
            self.optimizer.zero_grad(set_to_none=True)
        recipe = self.recipe
        loss = forward_backward(self.model, batch, recipe.task, self.trainers.axis_size("dp"), recipe.accumulate,
                                self._grad_sync, self._backward, loss=recipe.loss, amp=self.amp)
        with phase("update"):
            self.amp.unscale(self.optimizer)  # 16-mixed: the exchanged gradients at their true size, before clipping
            if recipe.clip_grad_norm is not None:  # the exchanged gradients: clipped sync equals clipped single
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), recipe.clip_grad_norm)
            with self.phase("optimizer"):
                self._optimizer_step(self.optimizer)
        examples = len(batch)
        self.traffic.examples += examples
        return StepResult(loss, examples, self._take_wait())

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """(summed loss, correct, units) of one evaluation batch as a float64 tensor on the device; None on
        a rank that computes no loss. The trainer sums these over :attr:`trainers`."""
        assert self.model is not None
        device = self.topology.device
        with self.amp.autocast():
            task = self.recipe.task
            score = task.score(self.model(self.amp.inputs(inputs), **task.model_kwargs(inputs)), targets)
        return torch.stack([v.to(device).double() for v in score])

    def finish(self) -> None:
        """Called on every trainer rank once training has ended well (e.g. to tell servers to stop)."""

    def describe(self) -> str:
        return f"{self.name}: {self.topology.describe()}"

    # -- numbers of its own ----------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        """This rank's strategy-specific numbers since the last call (bytes sent, staleness, ...), called at
        every log point on every trainer rank; the step record lists each key per rank (``rank_<key>``). By
        default the bytes counted in :attr:`traffic` (``bytes_sent``, ``bytes_received``), and under
        ``--precision 16-mixed`` the steps skipped for overflowing gradients and the loss scale."""
        return {**self.traffic.take(), **self.amp.take_metrics()}

    def summary_metrics(self) -> dict[str, Any]:
        """Numbers for the run's end summary (e.g. the servers' staleness histogram), on the trainers' rank 0.
        Collective over the trainer ranks: every one calls it once, after the last step. By default the
        totals of :attr:`traffic` over the trainers (bytes sent and received, per rank and per example), and
        under ``--precision 16-mixed`` the steps skipped (``precision_skipped_steps``)."""
        return {**self.traffic.summary(self.trainers), **self.amp.summary(self.trainers)}

    # -- the whole model's state -----------------------------------------------------------------------

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        """The whole model (and, with ``optimizer``, the optimizer's state), strategy-neutral, as ``single``
        saves them: ``{"model": ..., "optimizer": ...}`` on the trainers' rank 0, None elsewhere. Collective:
        every rank calls it (a strategy may gather the model's parts)."""
        if not self.trainers.is_main:
            return None
        assert self.optimizer is not None
        return {"model": self.module.state_dict(), **({"optimizer": self.optimizer.state_dict()} if optimizer else {})}

    def local_state(self) -> dict[str, Any]:
        """This rank's own model and optimizer state, live tensors, no collective (``{"model": ...,
        "optimizer": ...}``, and what the strategy keeps besides: diloco's ``outer``, its anchor and outer
        optimizer): what a rank hands a peer under ``--on-failure continue``, and what its memory meter counts.
        :meth:`load_state_dict` takes it back."""
        assert self.optimizer is not None
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (every rank gets the same ``state``)."""
        assert self.optimizer is not None
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # -- hooks for strategies (protected) --------------------------------------------------------------

    def _materialize(self, model: nn.Module) -> nn.Module:
        """The model with real tensors, if it was built on the meta device: by default the whole of it (a
        strategy that keeps a part of the model makes only that part, in ``_wrap``)."""
        return materialize_all(model)

    def _wrap(self, model: nn.Module) -> nn.Module:
        """This rank's model on its device (wrapped for the exchange where the strategy needs it)."""
        return model.to(self.topology.device)

    def _unwrap(self, model: nn.Module) -> nn.Module:
        """The plain module under any wrapper :meth:`_wrap` put around ``model``."""
        return model

    def _set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def _grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        """Context for one micro-batch's backward; ``enabled=False`` defers gradient exchange."""
        return _NOTHING

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.amp.step(optimizer)  # 16-mixed: skipped (and counted) when the gradients overflowed

    def _precision_runtime(self) -> Amp:
        """This rank's :class:`~polytrain.precision.Amp` for ``recipe.precision``: inactive for a mode this
        strategy carries out itself (``traits.own_precision``)."""
        precision = self.recipe.precision
        return Amp(precision, self.topology.device, active=precision.name not in self.traits.own_precision)

    def _take_wait(self) -> float:
        """Seconds this rank spent waiting for other ranks in the step just taken (for per-rank throughput)."""
        return 0.0


def check_batch(slices: int, global_batch: int, accumulate: int) -> None:
    """The global batch must cut into ``slices`` equal slices of ``accumulate`` equal micro-batches."""
    if slices > 1 and global_batch % slices:
        below, above = global_batch // slices * slices, (global_batch // slices + 1) * slices
        fits = f"{below} or {above}" if below else f"{above}"
        raise ConfigError(
            f"--batch-size {global_batch} does not divide over {slices} workers; pass a multiple of "
            f"{slices} (--batch-size {fits}), or --worker-batch-size B for B examples per worker"
        )
    per = global_batch // slices
    if per % accumulate:
        raise ConfigError(f"each worker's batch ({per}) must be divisible by --accumulate ({accumulate})")


def data_slice(strategy: Strategy) -> Slice:
    """This rank's equal slice of each global batch, from its place on the trainers' ``dp`` axis (for evaluation,
    and for training where nothing re-sizes or hands out slices)."""
    return Slice(strategy.trainers.axis_rank("dp"), strategy.trainers.axis_size("dp"))


def layout_for(cls: type[Strategy], processes: int, options: Any = None) -> Layout:
    """The layout of ``cls`` that has ``processes`` processes (for a strategy made in a process group of that
    size, or under torchrun): the one for the largest ``--workers`` that gives it."""
    for workers in range(processes, 0, -1):
        layout = cls.layout(workers, options)
        if layout.processes == processes:
            return layout
    raise ConfigError(f"--strategy {cls.name} cannot lay out {processes} process(es) "
                      f"(with these settings it takes {cls.layout(None, options).processes})")
