"""The Strategy protocol and the name registry.

A strategy owns everything that differs between ways of training one model over processes and devices:

* the layout (:meth:`Strategy.processes`, :meth:`Strategy.arrange`): how many processes ``--workers N``
  needs, and how they lie on the named ``dp``/``pp`` axes;
* each rank's :attr:`~Strategy.role`: ``trainer`` ranks run the trainer's loop, ``server`` ranks (and
  ``helper`` ranks, which compute work handed out by a server outside the trainer's loop) run
  :meth:`~Strategy.serve` instead;
* the model and optimizer (:meth:`~Strategy.prepare`), the step (:meth:`~Strategy.train_step`: micro-batches,
  forward, backward, exchange, update), evaluation (:meth:`~Strategy.eval_step`), and the whole model's
  state (:meth:`~Strategy.state_dict`, strategy-neutral: what ``single`` saves, loadable by any strategy);
* which ranks hold the loss (:attr:`StepResult.loss` is None elsewhere) and the group the trainer reduces
  metrics over (:attr:`~Strategy.trainers`).

The base class is the single-process, data-parallel-ready behaviour; ``single`` is it unchanged and ``sync``
overrides the exchange. Strategies are chosen by name (``--strategy sync``) or as ``package.module:Class``;
the trainer never asks which one it has.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
from typing import Any, Callable, ClassVar, ContextManager, Iterable, Iterator

import torch
from torch import nn

from polytrain.data.batches import Batch, BatchPlan, Shard, ShardedBatches
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError
from polytrain.options import section_defaults
from polytrain.strategies.step import RunSource, StepRecipe, StepResult, forward_backward
from polytrain.strategies.traffic import Traffic

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
ROLES = ("trainer", "server", "helper")


class Strategy:
    """Base class with the single-process behaviour; subclasses override what differs."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: whether the strategy needs one process per worker (False: it runs in the launching process)
    multiprocess: ClassVar[bool] = False
    #: the RunConfig section holding this strategy's own options (registered with ``register_section``)
    config_section: ClassVar[str] = ""

    def __init__(self, topology: Topology, options: Any = None):
        self.options = self.options_or_defaults(options)  # before arrange(), which may read them
        self.topology = self.arrange(topology)
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.recipe = StepRecipe()
        self.source: RunSource | None = None  # any step's batch and LR (the trainer binds it)
        #: this rank's bytes sent and received in the exchange, and examples trained on (for bytes per example)
        self.traffic = Traffic()
        #: labels a part of the step in the per-operator placement log (the trainer's device runtime sets it)
        self.phase: Callable[[str], ContextManager[Any]] = lambda name: contextlib.nullcontext()

    @classmethod
    def options_or_defaults(cls, options: Any = None) -> Any:
        """``options``, or the defaults of the strategy's config section (None if it has none)."""
        return options if options is not None else section_defaults(cls.config_section)

    # -- layout, checked before any process starts -------------------------------------------------

    @classmethod
    def processes(cls, workers: int, options: Any = None) -> int:
        """How many processes to launch for ``--workers N``."""
        return workers if cls.multiprocess else 1

    @classmethod
    def rank_names(cls, workers: int, options: Any = None) -> list[str] | None:
        """What each launched process is called when the launcher reports its failure (None: "worker rank N")."""
        return None

    @classmethod
    def expendable_ranks(cls, workers: int, options: Any = None) -> list[int]:
        """Ranks the job goes on without if they die (``--tolerate-worker-loss``); none by default."""
        return []

    @classmethod
    def data_slices(cls, workers: int, options: Any = None) -> int:
        """How many slices each global batch is cut into (the size of the ``dp`` axis)."""
        return cls.processes(workers, options)

    @classmethod
    def check(cls, workers: int, global_batch: int, accumulate: int, options: Any = None) -> None:
        """Validate settings before any process starts; raise ConfigError with the fix. ``workers`` is
        ``--workers``, resolved to a number; ``global_batch`` the examples of one global batch."""
        cls.check_batch(cls.data_slices(workers, options), global_batch, accumulate)

    @classmethod
    def check_config(cls, config: Any, model: nn.Module | None) -> None:
        """Checks that need the whole run config or the model (a pipeline: enough layers for its stages),
        before any process starts; ``model`` is the user's module, or None when it is named in the config."""

    @staticmethod
    def check_batch(slices: int, global_batch: int, accumulate: int) -> None:
        """The global batch must cut into ``slices`` equal slices of ``accumulate`` equal micro-batches."""
        if slices > 1 and global_batch % slices:
            raise ConfigError(
                f"--batch-size {global_batch} does not divide over {slices} workers; pass a multiple of "
                f"{slices}, or --worker-batch-size B for B examples per worker"
            )
        per = global_batch // slices
        if per % accumulate:
            raise ConfigError(f"each worker's batch ({per}) must be divisible by --accumulate ({accumulate})")

    def arrange(self, topology: Topology) -> Topology:
        """The world laid out on named axes; by default every process is a data-parallel replica."""
        return topology.arranged(dp=topology.world_size) if topology.distributed else topology

    @property
    def role(self) -> str:
        """``trainer`` (runs the trainer's loop), or ``server`` or ``helper`` (runs :meth:`serve`)."""
        return "trainer"

    @property
    def trainers(self) -> Topology:
        """The trainer ranks as a topology of their own: metrics, evaluation and the NaN guard are
        reduced over it, and its rank 0 logs."""
        return self.topology

    def bind(self, source: RunSource) -> None:
        """Called by the trainer on every rank before training: any step's batch and learning rate, for a
        strategy whose ranks take work out of step order (a ``helper`` rank's loop)."""
        self.source = source

    def serve(self) -> dict[str, Any]:
        """A ``server`` or ``helper`` rank's whole loop; returns its summary."""
        raise NotImplementedError(f"strategy {self.name} has no server ranks")

    def finish(self) -> None:
        """Called on every trainer rank once training has ended well (e.g. to tell servers to stop)."""

    # -- data ---------------------------------------------------------------------------------------

    def data_shard(self) -> Shard:
        """This rank's equal slice of each global batch, from its place on the trainers' ``dp`` axis."""
        return Shard(self.trainers.axis_rank("dp"), self.trainers.axis_size("dp"))

    def batch_slices(self) -> int:
        """How many equal slices a global batch is cut into (what ``--worker-batch-size`` is multiplied by):
        by default the trainers' ``dp`` axis; a strategy whose trainers' group is not its data-parallel width
        says its own."""
        return self.data_shard().count

    def step_shards(self, global_batch: int, accumulate: int, data_workers: int = 0,
                    deterministic: bool = False) -> Shard | Callable[[int], Shard]:
        """The slices the trainer draws: the fixed ``data_shard()``, or a function giving each step's (a
        strategy that re-splits batches as it goes). Called once, after ``prepare``."""
        return self.data_shard()

    def sharded_batches(self, dataset: Any, plan: BatchPlan, shards: Shard | Callable[[int], Shard] | None = None,
                        start_step: int = 0, data_workers: int = 0) -> ShardedBatches:
        """This rank's batches of ``plan``, as :class:`Batch` objects on its device: the one path by which
        the trainer and an own loop (:meth:`batches`) draw data."""
        return ShardedBatches(dataset, plan, self.data_shard() if shards is None else shards,
                              self.topology.device, start_step, data_workers)

    def batches(self, dataset: Any, batch_size: int, *, steps: int | None = None, epochs: int | None = None,
                seed: int = 0, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's part of each global batch of ``batch_size`` examples, on this process's device,
        the same slices the trainer takes. Stops after ``steps`` optimizer steps or ``epochs`` passes (one
        epoch if neither is given)."""
        plan = BatchPlan(len(dataset), batch_size, seed)
        shard = self.data_shard()
        if batch_size % shard.count:
            raise ConfigError(f"batch size {batch_size} does not divide over {shard.count} workers")
        total = steps if steps is not None else (epochs or 1) * plan.steps_per_epoch
        for batch in self.sharded_batches(dataset, plan, shard, start_step):
            if batch.step >= total:
                return
            yield batch.inputs, batch.targets

    # -- model and optimizer -----------------------------------------------------------------------

    def prepare_model(self, model: nn.Module) -> nn.Module:
        """This rank's model on its device (wrapped for the exchange where the strategy needs it)."""
        return model.to(self.topology.device)

    def prepare(self, model: nn.Module, make_optimizer: OptimizerFactory, recipe: StepRecipe | None = None,
                place: Callable[[nn.Module], None] | None = None) -> nn.Module:
        """Take ``model`` (built alike on every rank), move and wrap it, let ``place`` put its sub-modules
        where the user asked, and build the optimizer over what this rank updates. Returns this rank's model."""
        self.model = self.prepare_model(model)
        if place is not None:
            place(self.model)
        self.optimizer = make_optimizer(self.model.parameters())
        self.recipe = recipe or StepRecipe()
        return self.model

    def unwrap(self, model: nn.Module | None = None) -> nn.Module:
        """The plain module under any wrapper (DDP) of ``model`` (default: the prepared one)."""
        return self.model if model is None else model

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    # -- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Batch) -> StepResult:
        """One optimizer step on this rank's slice: forward, backward, exchange, update."""
        assert self.model is not None and self.optimizer is not None, "call prepare() first"
        self.optimizer.zero_grad(set_to_none=True)
        recipe = self.recipe
        loss = forward_backward(self.model, batch, recipe.task, self.trainers.axis_size("dp"), recipe.accumulate,
                                self.grad_sync, self.backward, loss=recipe.loss)
        if recipe.clip_grad_norm is not None:  # the exchanged gradients: clipped sync equals clipped single
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), recipe.clip_grad_norm)
        with self.phase("optimizer"):
            self.optimizer_step(self.optimizer)
        self.traffic.examples += len(batch)
        return StepResult(loss, len(batch))

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """(summed loss, correct, units) of one evaluation batch as a float64 tensor on the device; None on
        a rank that computes no loss. The trainer sums these over :attr:`trainers`."""
        assert self.model is not None
        device = self.topology.device
        return torch.stack([v.to(device).double() for v in self.recipe.task.score(self.model(inputs), targets)])

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        """Context for one micro-batch's backward; ``enabled=False`` defers gradient exchange."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def syncs_at(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) holds a collective over every trainer rank (an all-reduce, a
        pipeline schedule, an averaging), so that no trainer rank ends it before every other one began it:
        where the ranks can agree on a step to stop at without waiting for each other
        (:mod:`polytrain.distributed.stop`). Every step, by default."""
        return True

    def take_wait_seconds(self) -> float:
        """Seconds this rank spent waiting for other ranks since the last call (for per-rank throughput)."""
        return 0.0

    def take_metrics(self) -> dict[str, float]:
        """This rank's strategy-specific numbers since the last call (bytes sent, staleness, ...), called at
        every log point on every trainer rank; the step record lists each key per rank (``rank_<key>``). By
        default the bytes counted in :attr:`traffic` (``bytes_sent``, ``bytes_received``)."""
        return self.traffic.take()

    def summary_metrics(self) -> dict[str, Any]:
        """Numbers for the run's end summary (e.g. the servers' staleness histogram), on the trainers' rank 0.
        Collective over the trainer ranks: every one calls it once, after the last step. By default the
        totals of :attr:`traffic` over the trainers (bytes sent and received, per rank and per example)."""
        return self.traffic.summary(self.trainers)

    # -- the whole model's state -------------------------------------------------------------------

    def model_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's ``state_dict`` as ``single`` would save it, on the trainers' rank 0 (None on
        other ranks). Collective: every rank calls it."""
        return self.unwrap().state_dict() if self.trainers.is_main else None

    def state_dict(self) -> dict[str, Any] | None:
        """Model and optimizer, strategy-neutral, on the trainers' rank 0 (None elsewhere). Collective."""
        model = self.model_state_dict()
        assert self.optimizer is not None
        optimizer = self.optimizer.state_dict() if self.trainers.is_main else None
        return None if model is None else {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (every rank gets the same ``state``)."""
        assert self.optimizer is not None
        self.unwrap().load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def describe(self) -> str:
        return f"{self.name}: {self.topology.describe()}"


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``; a name is taken once."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name`")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        taken = _REGISTRY[cls.name]
        raise ValueError(f"strategy name '{cls.name}' is taken by {taken.__module__}.{taken.__qualname__}; "
                         f"give {cls.__module__}.{cls.__qualname__} another name")
    _REGISTRY[cls.name] = cls
    return cls


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type[Strategy]:
    """The strategy registered as ``name``, or the class ``package.module:Class`` (imported, so a strategy
    defined in your own module works in every spawned worker too)."""
    if ":" in name:
        return _import_strategy(name)
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"--strategy: unknown strategy '{name}'{hint}; available: "
                          f"{', '.join(available_strategies())}, or package.module:Class") from None


def strategy_sections() -> dict[str, list[str]]:
    """Each strategy's config section and the strategies that read it (``periodic``: local-sgd, diloco)."""
    owners: dict[str, list[str]] = {}
    for name, cls in sorted(_REGISTRY.items()):
        if cls.config_section:
            owners.setdefault(cls.config_section, []).append(name)
    return owners


def unread_settings(config: Any, strategy: type[Strategy]) -> list[tuple[str, Any, list[str]]]:
    """Settings changed from their default in another strategy's config section, which ``strategy`` never
    reads: (key, value, the strategies that read it)."""
    out = []
    for section, owners in strategy_sections().items():
        if section == strategy.config_section:
            continue
        values, defaults = getattr(config, section), section_defaults(section)
        out += [(f.name, getattr(values, f.name), owners) for f in dataclasses.fields(values)
                if getattr(values, f.name) != getattr(defaults, f.name)]
    return out


def check_settings_read(config: Any, strategy: type[Strategy]) -> None:
    """One error line when a setting of another strategy was given: the run would ignore it (``--servers 2``
    or ``--tolerate-worker-loss`` with ``--strategy sync``), and a run that drops what was asked is not the
    run that was asked for."""
    unread = unread_settings(config, strategy)
    if not unread:
        return
    if len(unread) == 1:
        (key, value, owners), = unread
        raise ConfigError(f"{_flag(key, value)} is a setting of --strategy {' and '.join(owners)}, which "
                          f"--strategy {strategy.name} does not read; drop it, or use {' or '.join(owners)}")
    given = ", ".join(f"{_flag(key, value)} ({', '.join(owners)})" for key, value, owners in unread)
    raise ConfigError(f"{given}: settings of other strategies, which --strategy {strategy.name} does not read; "
                      "drop them")


def _flag(key: str, value: Any) -> str:
    flag = "--" + key.replace("_", "-")
    return flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}"


def _import_strategy(spec: str) -> type[Strategy]:
    module_name, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--strategy {spec}: cannot import it ({exc})") from None
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError(f"--strategy {spec}: not a polytrain.Strategy subclass")
    return found
