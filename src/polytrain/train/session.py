"""Everything a run needs, built from the config in a fixed order, and resumed from a checkpoint.

Order: seed → data → strategy (which lays the world out on its axes) and this rank's data slice → batch
plan → model (prepared by the strategy: moved to the worker's device and wrapped, its sub-modules placed by
``--place``/``--placement``, the optimizer built over what this rank updates) → LR schedule → checkpoint
resume (:mod:`.resume`). Every rank builds the same thing from the same seed; after a membership change
(``--on-failure continue``) the survivors build their strategy again through the same functions
(:func:`make_strategy`, :func:`prepare_strategy`).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from polytrain.config import RunConfig, to_toml
from polytrain.data.base import DataBundle
from polytrain.data.batches import BatchPlan, Slice
from polytrain.data.buckets import batch_plan
from polytrain.data.stream import StreamBatches, StreamPlan, TokenStream
from polytrain.devices.host_memory import describe_host_memory
from polytrain.devices.placement import model_devices
from polytrain.devices.runtime import DeviceRuntime
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError, DeviceError
from polytrain.log import get_logger
from polytrain.models.deferred import build_for_run
from polytrain.weights.export import hf_config_text
from polytrain.weights.start import given_model, weights_to_load
from polytrain.models.lm import check_lm_compat
from polytrain.models.registry import build_model
from polytrain.models.lora import apply_lora, describe as describe_lora
from polytrain.models.replay import build_parts
from polytrain.precision import cast_model, file_signature, precision_of, to_float32
from polytrain.distributed.layout import Layout
from polytrain.strategies import Strategy
from polytrain.strategies.base import check_batch, data_slice
from polytrain.strategies.registry import strategy_class
from polytrain.strategies.step import StepRecipe
from polytrain.train.checkpoint import Checkpointer, capture_rng
from polytrain.train.background import CheckpointWrites, copy_state
from polytrain.train import reshard
from polytrain.train.on_failure import continuing
from polytrain.train.optim import build_optimizer
from polytrain.train.resume import resume
from polytrain.train.unit_options import apply_unit_options, describe_unit_options
from polytrain.train.reshard import DataPosition
from polytrain.train.lr_schedules import LRSchedule, parse_lr_schedule, scaled_lr
from polytrain.tasks import Task, check_takes_labels, get_task, packed_task

#: the opening line saying what is minimised, for each --loss
_LOSS_LINES = {
    "task": "the task's ({task}) loss on the model's outputs (or their .logits)",
    "model": "the model's own .loss, given labels= (--loss model; task {task} for evaluation)",
}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class Session:
    config: RunConfig
    topology: Topology
    data: DataBundle
    strategy: Strategy
    slice: Slice  # this rank's equal slice of each global batch (evaluation's too)
    plan: BatchPlan | StreamPlan
    model: nn.Module  # this rank's prepared model (wrapped, or a pipeline stage)
    task: Task
    lr_schedule: LRSchedule | reshard.Rescaled  # Rescaled: moving to a new global batch's LR after a resume
    total_steps: int
    checkpointer: Checkpointer | None
    #: the slices the trainer draws: ``slice``, the whole batch (work handed out at run time), or a function
    #: of the step (slices re-sized by speed)
    step_slices: Slice | Callable[[int], Slice]
    start_step: int = 0
    devices: DeviceRuntime = field(default_factory=DeviceRuntime)
    #: a stream's batches as the trainer draws them: where each of this rank's lanes is (for checkpoints)
    stream: StreamBatches | None = None
    #: where the model's starting weights come from, for the start-up line (``initialised from --seed 0``, ...)
    weights: str = ""
    _config_flat: dict[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def log(self):
        return get_logger()

    @property
    def config_flat(self) -> dict[str, Any]:
        """The config as ``{key: value}``, made once (every checkpoint and snapshot holds it)."""
        if self._config_flat is None:
            self._config_flat = self.config.flat()
        return self._config_flat

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.strategy.optimizer

    @property
    def config_toml(self) -> str:
        return to_toml(self.config, comment="resolved polytrain config; reuse with: polytrain train --config FILE")

    def save_checkpoint(self, step: int, writes: CheckpointWrites, background: bool = False,
                        checkpointer: Checkpointer | None = None) -> None:
        """Start writing step ``step``'s checkpoint with ``checkpointer`` (default: the run's; a snapshot's:
        train/snapshot.py) through ``writes`` (in its thread when ``background`` and ``writes.background``: from
        a copy of the state in host memory); ``writes.settle`` waits for it and
        returns its path on the trainers' rank 0. Collective over the trainer ranks. A strategy that holds
        shards (``sharded_state``) has each rank write its own part, gathering nothing; any other gathers the
        whole state to rank 0."""
        checkpointer = checkpointer or self.checkpointer
        assert checkpointer is not None
        copied = background and writes.background
        shards = self.strategy.sharded_state
        if shards is None:
            state = self.state_dict(step)
            if state is None:  # (not the trainers' rank 0: nothing to write)
                writes.start(lambda: None, background=False)
                return
            state = copy_state(state) if copied else state
            writes.start(lambda: checkpointer.save(state, step), background=background)
            return
        part = to_float32(shards.part())  # bf16-true's bfloat16 widened (exact): every checkpoint is float32
        part = copy_state(part) if copied else part
        meta = self._run_state(step)
        if meta is not None:
            skeleton = shards.skeleton()
            meta["sharded"] = {"parts": self.strategy.trainers.world_size, "param_groups": skeleton["param_groups"],
                               "model": file_signature(skeleton["model"], self.strategy.amp.precision)}
        group = self.strategy.trainers
        writes.start(lambda: checkpointer.write_part(part, step, group),
                     commit=lambda written: checkpointer.commit_parts(meta, written, step, group),
                     background=background)

    def state_dict(self, step: int) -> dict[str, Any] | None:
        """Checkpoint contents, on the trainers' rank 0 (None elsewhere). Collective over the trainer ranks:
        the strategy gathers the whole model and optimizer, the session every trainer's RNG states."""
        model_and_optimizer = self.strategy.state_dict()
        run = self._run_state(step)
        if run is None:
            return None
        assert model_and_optimizer is not None
        return {**to_float32(model_and_optimizer), **run}  # float32 whatever --precision (bf16-true: exact)

    def _run_state(self, step: int) -> dict[str, Any] | None:
        """What a checkpoint holds besides the model and optimizer, on the trainers' rank 0 (None elsewhere).
        Collective: every trainer's RNG states are gathered."""
        trainers = self.strategy.trainers
        lanes = self.stream.position() if self.stream is not None else None
        gathered = trainers.all_gather_object((capture_rng(), lanes))  # (a stream's lanes are on their ranks)
        if not trainers.is_main:
            return None
        rng = [r for r, _ in gathered]
        position = self.plan.checkpoint_position([mine for _, mine in gathered]) \
            if isinstance(self.plan, StreamPlan) else DataPosition.at(self.plan, step).as_dict()
        return {
            **self.strategy.amp.state_dict(),  # 16-mixed: the loss scaler's scale and growth count
            "schedule": str(self.lr_schedule),
            "lr": float(self.lr_schedule(step)),  # the next step's: where a resume at another batch starts from
            "data_position": position,
            "rng": rng,
            "world_size": trainers.world_size,
            "strategy": self.config.train.strategy,
            "config": self.config_flat,
            **({"hf_config": hf} if (hf := hf_config_text(self.strategy.module)) else {}),  # (export's config.json)
        }

    def describe(self) -> str:
        cfg = self.config
        params = sum(p.numel() for p in self.strategy.module.parameters())
        per_worker = self.plan.global_batch // self.slice.count
        batch = f"{self.plan.global_batch}" + (f" = {self.slice.count} x {per_worker}" if self.slice.count > 1 else "")
        epoch = (f"{self.plan.steps_per_epoch} steps/epoch" if self.plan.steps_per_epoch is not None else
                 f"streamed in {self.plan.lanes} lanes")
        lines = [
            f"strategy {self.strategy.describe()}",
            f"data {self.data.describe()}",
            *_tokenizer_line(self.config),
            f"model {cfg.model.model}: {params:,} parameters; {self.weights}" if self.weights else
            f"model {cfg.model.model}: {params:,} parameters",
            f"batch {batch}; {epoch}; training {self.total_steps} steps"
            + (f" from step {self.start_step}" if self.start_step else ""),
            *describe_unit_options(cfg.units, self.strategy.module),
            *filter(None, [describe_lora(self.strategy.module)]),
            f"loss: {_LOSS_LINES[cfg.train.loss].format(task=self.task.name)}",
            f"precision {self.strategy.amp.describe()}",
            f"optimizer {cfg.optim.optimizer}, lr {self.lr_schedule.base_lr:g}, schedule {self.lr_schedule}",
            f"process: {torch.get_num_threads()} CPU thread(s) per worker, {describe_host_memory()}",
        ]
        return "\n".join(lines)


def _tokenizer_line(config: RunConfig) -> list[str]:
    from polytrain.data.registry import tokenizer_of
    from polytrain.data.tokenizer import cached_tokenizer

    name = tokenizer_of(config)
    if name is None:
        return []
    own = "" if config.data.tokenizer else " (--model's own)"
    return [cached_tokenizer(name).describe() + own]


def build(config: RunConfig, topology: Topology, *, model: nn.Module | None = None,
          data: DataBundle | None = None, layout: Layout | None = None,
          before_strategy: Callable[[], None] | None = None) -> Session:
    """This rank's session for ``config``; ``layout``: the job's, as the launching process decided it (None:
    the strategy's for this process group's size); ``before_strategy``: called just before the strategy is made
    (a replacement waits there for its new peers: :meth:`~polytrain.distributed.elastic.Membership.ready_to_build`)."""
    config = copy.deepcopy(config)
    seed_everything(config.train.seed)
    if config.train.deterministic:
        torch.use_deterministic_algorithms(True)
    data = data if data is not None else _build_data(config)
    if before_strategy is not None:
        before_strategy()
    strategy = make_strategy(config, topology, layout)
    mine, slices = data_slice(strategy), strategy.layout.slices
    global_batch = config.global_batch(slices)
    check_batch(slices, global_batch, config.train.accumulate)
    plan = _plan(data, global_batch, config, strategy, mine)
    total_steps = reshard.total_steps(plan, config.train.steps, config.train.epochs)
    if model is None:
        if config.model.model == "auto":
            config.model.model = data.default_model
        def build() -> nn.Module:
            return build_model(config.model.model, config.model.model_args, input_shape=data.input_shape,
                               num_classes=data.num_outputs)

        # on the meta device where the model can be materialised unit by unit and its factory gives it no weights
        # of its own: the strategy makes what it keeps (replay: a pipeline makes only its stages of any factory's)
        model, weights = build_for_run(build, config.train.seed,
                                       build_parts if strategy.traits.builds_part else None,
                                       source=weights_to_load(config))
    else:
        model, weights = given_model(model, weights_to_load(config))
    check_lm_compat(data, model, config.model.model)
    if config.train.loss == "model":
        check_takes_labels(model, config.model.model)
    devices = _device_runtime(config, topology)
    lr = run_lr(config, global_batch)
    task = get_task(data.task) if data.document_end is None else packed_task(data.document_end, model,
                                                                             config.model.model)
    recipe = StepRecipe(task, config.train.accumulate, config.optim.clip_grad_norm, config.train.loss,
                        precision_of(config))
    model = apply_lora(model, config.lora.lora)  # --lora: adapters put in, the model's own weights frozen
    model = cast_model(model, recipe.precision, strategy.traits.own_precision)  # bf16-true: in bfloat16 before prepare
    model = apply_unit_options(model, config.units)  # --activation-checkpointing, --compile: per unit, before any wrap
    model = prepare_strategy(strategy, model, config, recipe, devices, lr)
    lr_schedule = parse_lr_schedule(config.optim.lr_schedule, lr, total_steps)
    checkpointer = (Checkpointer(config.checkpoint.checkpoint_dir, config.checkpoint.keep_checkpoints,
                                 config.checkpoint.on_checkpoint_error) if config.checkpoint.checkpoint_dir else None)
    session = Session(config, topology, data, strategy, mine, plan, model, task, lr_schedule, total_steps,
                      checkpointer, _step_slices(strategy, mine, global_batch, config), devices=devices,
                      weights=weights)
    if config.checkpoint.resume:
        resume(session)
    devices.log_steps_from(session.start_step, config.device.log_placement_steps)
    return session


def make_strategy(config: RunConfig, topology: Topology, layout: Layout | None) -> Strategy:
    """This rank's strategy: the class that runs the layout's degrees, with its options, over ``topology`` (at a
    start, and over the survivors after a membership change: :mod:`polytrain.train.elastic`)."""
    strategy_cls = strategy_class(config, layout, topology.world_size)
    return strategy_cls(topology, strategy_options(config, strategy_cls), layout)


def prepare_strategy(strategy: Strategy, model: nn.Module, config: RunConfig, recipe: StepRecipe,
                     devices: DeviceRuntime, lr: float) -> nn.Module:
    """``model`` prepared by ``strategy`` (moved, wrapped or cut, its sub-modules placed as ``--place`` says),
    the optimizer built over what this rank updates; at a start and after a membership change alike."""
    model = strategy.prepare(model, lambda params: build_optimizer(params, config.optim, lr), recipe,
                             place=lambda m: _place(devices, config, strategy, m))
    strategy.phase = devices.phase
    return model


def run_lr(config: RunConfig, global_batch: int) -> float:
    """The base learning rate for ``global_batch`` examples a step (``--lr-scaling``)."""
    return scaled_lr(config.optim.lr, config.optim.lr_scaling, global_batch, config.optim.base_batch_size)


def _plan(data: DataBundle, global_batch: int, config: RunConfig, strategy: Strategy,
          mine: Slice) -> BatchPlan | StreamPlan:
    """The plan of the global batches: a stream's lanes (see :mod:`polytrain.data.stream`), else the epochs'
    permutations (bucketed by length where the data asks)."""
    if isinstance(data.train, TokenStream):
        if strategy.rebalancing is not None or strategy.out_of_order is not None or continuing(config):
            raise ConfigError(f"--data {data.name}: a stream is read in order, each rank its own lanes; it cannot "
                              "hand slices of any step to any rank (--rebalance, --tolerate-worker-loss, "
                              "--on-failure continue); use a map-style dataset (hf: without stream=true) for them")
        return StreamPlan.make(data.train, global_batch, mine.count)
    try:
        return batch_plan(data.train, global_batch, config.train.seed, data.bucket_window)
    except ValueError as exc:
        raise ConfigError(f"--batch-size: {exc}; use a smaller batch or fewer workers") from None


def _step_slices(strategy: Strategy, mine: Slice, global_batch: int,
                 config: RunConfig) -> Slice | Callable[[int], Slice]:
    """The slices the trainer draws: re-sized by speed (``rebalancing``), the whole batch for a rank whose
    work is handed out at run time (``out_of_order``), else this rank's equal slice."""
    if strategy.rebalancing is not None:
        return strategy.rebalancing.slices(global_batch, config.train.accumulate, config.data.data_workers,
                                           config.train.deterministic)
    return Slice(0, 1) if strategy.out_of_order is not None else mine


def strategy_options(config: RunConfig, strategy_cls: type[Strategy]) -> Any:
    """The config section of ``strategy_cls``'s own options (None if it has none), with the sections it also
    reads (``traits.reads``: pipeline's and hybrid's tp axis)."""
    from polytrain.strategies.settings import options_of

    return options_of(config, strategy_cls)


def _device_runtime(config: RunConfig, topology: Topology) -> DeviceRuntime:
    dev = config.device
    return DeviceRuntime(soft=dev.soft_placement, log_placement=dev.log_placement, rank=topology.rank,
                         local_rank=topology.local_rank, log_dir=config.log.log_dir,
                         gpu_memory_fraction=dev.gpu_memory_fraction)


def _place(devices: DeviceRuntime, config: RunConfig, strategy: Strategy, model: nn.Module) -> None:
    """Place the sub-modules of this worker's model (already on its device) as the plan says.

    Called by the strategy's ``prepare`` after it moved the whole model to the worker's device (placing
    before would be undone) and before the optimizer is built. A strategy that wraps the model (DDP) has
    built its gradient buckets on that device by then, so with one the plan may not move parameters elsewhere.
    """
    home = strategy.topology.device
    unwrapped = strategy.module
    devices.prepare(unwrapped, config.device.plan(), home=home)
    if unwrapped is not model and model_devices(unwrapped) not in ([], [home]):
        spread = ", ".join(str(d) for d in model_devices(unwrapped))
        raise DeviceError(f"--strategy {config.train.strategy} keeps one whole replica per worker on its device "
                          f"({home}), but the placement puts this worker's model on {spread}; "
                          "use --strategy single for layers on several devices, or place them on "
                          f"{home}")


def _build_data(config: RunConfig) -> DataBundle:
    from polytrain.data.registry import data_of
    return data_of(config)
