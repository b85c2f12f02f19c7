"""``pipeline`` and ``hybrid``: the model's layers split into stages, one process each, micro-batched by a
``torch.distributed.pipelining`` schedule; ``hybrid`` runs D such pipelines side by side, data parallel.

Layout: ``pipeline`` starts ``--stages P`` processes (``--workers`` is not read: the processes are the
stages); ``hybrid`` starts ``--dp D`` x ``--pp P`` = ``--workers`` processes on a ``dp x pp`` DeviceMesh.
Every rank of one pipeline draws the same slice of each global batch (its ``dp`` coordinate's); the first
stage feeds the inputs in ``--microbatches M`` pieces, the last computes the task's loss on each.

The update equals ``single``'s: each micro-batch's mean loss is divided by ``loss_divisor`` (its share of
the global batch's units, over the D replicas), gradients are summed over the micro-batches (torch's
``scale_grads`` is off), averaged over ``dp`` in ``hybrid``, and ``--clip-grad-norm`` clips the norm over
all stages. No rank holds the whole model: a model built on the meta device (:mod:`polytrain.models.deferred`)
is materialised one unit at a time, each rank making only the units of its own stages, with ``single``'s
initial values (:mod:`.build`); the other stages' tensors stay in the model holding 0 bytes. The optimizer
is built over all the parameters, so its indices are ``single``'s; a rank keeps only its stages' gradients
and optimizer state. Checkpoints and ``--save-model`` gather each stage's tensors into the whole model's
state dict and optimizer state, as ``single`` saves them.

``hybrid --shard-dp`` (FSDP x pipeline on the same mesh): at first use each unit of a rank's stages and the
stage are ``fully_shard``-ed over ``dp`` (see :meth:`Pipeline._shard`), each replica holding 1/D of its stages'
parameters, gradients and optimizer state; gradients are reduce-scattered by FSDP instead of all-reduced, and
checkpoints gather the shards (``full_tensor``) before the stages.

With ``--split-at UNITS`` a rank makes its stages in ``prepare``. With ``--split-at auto`` the split is
chosen at the first step (or the first evaluation, when a resumed run has no step left) on rank 0, which
times every unit on one micro-batch, making each only while it is timed (see :mod:`.split`), and broadcasts
it, so all ranks cut alike; each rank then makes its stages (a checkpoint loaded before is applied then).
Either way rank 0 checks at first use that the forward is the units in order. The split is logged with
each stage's parameters (and measured ms). A model that cannot be built on the meta device is built whole
on every rank (with a warning), and the other stages' tensors are emptied at the cut.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from polytrain.data.batches import Batch
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.log import get_logger
from polytrain.models import replay
from polytrain.models.deferred import describe_whole_build, is_deferred
from polytrain.phases import phase
from polytrain.precision import refuse_loss_scaling
from polytrain.strategies.base import Strategy, check_batch
from polytrain.strategies.registry import register_strategy
from polytrain.parallel.dtensor import local
from polytrain.parallel.pp import plan, split, traced
from polytrain.parallel.pp.config import HybridDeclared, PipelineConfig, PipelineDeclared
from polytrain.parallel.pp.transport import check_transport
from polytrain.parallel.pp.traced_run import TracedRun, chain_kind, must_trace
from polytrain.parallel.pp.build import UnitMaker, release_unit
from polytrain.parallel.pp.stages import TimedStage, chain_forward
from polytrain.parallel.pp.replicas import StageReplicas, reshard
from polytrain.parallel.pp.state import StageState
from polytrain.strategies.step import StepResult, loss_divisor
from polytrain.tasks import check_takes_labels
from polytrain.parallel.tp import axis as tp_axis
from polytrain.parallel.tp.graph import plain_as_replicated


@register_strategy
class Pipeline(PipelineDeclared, StageReplicas, StageState, TracedRun, Strategy):

    def __init__(self, topology: Any, options: PipelineConfig | None = None, layout: Layout | None = None):
        if not topology.distributed:
            raise ConfigError(f"--strategy {self.name} needs one process per stage; it cannot run in one process")
        super().__init__(topology, options, layout)

    # -- layout and checks before launch ------------------------------------------------------------

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        """The batch in micro-batches, a schedule that fits, and what needs the model: enough units for the
        stages, ``--split-at`` naming units. Builds the model on the meta device (no memory) when it is given
        by name; a factory that needs the data's real shape is checked in the workers instead."""
        opts, accumulate = getattr(config, cls.config_section), config.train.accumulate
        dp, pp = layout.axis("dp"), layout.axis("pp")
        global_batch = config.global_batch(layout.slices)
        if accumulate != 1:
            raise ConfigError(f"--strategy {cls.name} accumulates over its --microbatches; pass --microbatches "
                              f"{opts.microbatches * accumulate} instead of --accumulate {accumulate}")
        check_batch(dp, global_batch, 1)
        per = global_batch // dp
        if per % opts.microbatches:
            raise ConfigError(f"--microbatches {opts.microbatches} does not divide each pipeline's batch of "
                              f"{per} examples; pass a divisor of {per} or another --batch-size")
        plan.check_schedule(opts.schedule, pp, opts.microbatches)
        if config.data.pack:
            raise ConfigError(f"--pack: --strategy {cls.name}'s stages pass one another activations only, not the "
                              "packed documents' position ids; use sync, fsdp or tp with --pack, or leave it out")
        tp_axis.check_axis(layout, config, model)
        check_transport(config, cls.name)
        refuse_loss_scaling(config, cls.name, "the pipelining schedule runs each micro-batch's backward itself, "
                                              "and an overflow on one stage would have to skip the step on all")
        if model is None and config.model.model != "auto":
            from polytrain.models.registry import meta_model

            model = meta_model(config)
        if model is not None and config.train.loss == "model":  # its own loss on the last stage: traced
            check_takes_labels(model, config.model.model)
        if model is not None:
            stages, starts = pp * plan.schedule_info(opts.schedule).chunks, split.parse_split(opts.split_at)
            if chain_kind(model) and not must_trace(model, starts, config.train.loss):
                split.check_split(model, stages, opts.split_at)
            elif starts is not None:  # cut by the tracer
                traced.check_starts(model, starts, stages)

    # -- model -------------------------------------------------------------------------------------

    def _materialize(self, model: nn.Module) -> nn.Module:
        return model  # a deferred model: only this rank's stages are made (_cut); a whole one as it is

    def _wrap(self, model: nn.Module) -> nn.Module:
        if is_deferred(model) or replay.recipe(model) is not None:
            return model  # on the meta device until this rank's stages are known (_replay: made by the tracer's cut)
        if self.topology.is_main:
            get_logger().warning(describe_whole_build(model, type(model).__name__))
        return model.to(self.topology.device)

    def prepare(self, model, make_optimizer, recipe=None, place=None):
        super().prepare(model, make_optimizer, recipe, place)  # every parameter: single's optimizer layout
        opts = self.options
        self._make_optimizer = make_optimizer
        self.info = plan.schedule_info(opts.schedule)
        self.ranks = self.topology.axis_size("pp")
        self.me = self.topology.axis_rank("pp")
        self.replicas = self.topology.axis_size("dp")  # the ranks of one stage that take slices: dp_replicate x dp_shard
        self.tp = self.topology.axis_size("tp")  # each stage's layers split over tp ranks (tensor parallel)
        self.num_stages = self.ranks * self.info.chunks
        #: --dp-shard: each stage fully_shard-ed over dp_shard (HSDP with dp_replicate), its tensors DTensors
        self.sharded = self.topology.axis_size("dp_shard") > 1
        self._stage_bytes = 0
        self.mine = plan.rank_stages(self.me, self.ranks, self.info.chunks, self.info.placement)
        self.split: split.Split | None = None
        self.modules: dict[int, nn.Module] = {}
        self.owned: list[nn.Parameter] = []
        self._owned_keys: tuple[str, ...] = ()
        self._busy = self._wall = self._busy_total = self._wall_total = 0.0
        self._global_units = 1
        self.schedule = None
        #: a deferred model's unit maker (None: the model was built whole); the state loaded before the cut
        self._maker = UnitMaker(self.model, self.topology.device) if is_deferred(self.model) else None
        self._replay = self._replay_recipe()  # a model from any factory, on meta: each rank makes its stages
        self._loaded: dict[str, Any] | None = None
        starts = split.parse_split(opts.split_at)
        if self._maker is not None and starts is not None and not must_trace(self.model, starts, self.recipe.loss):
            self._cut(split.named_split(self.model, self.num_stages, opts.split_at))  # no sample needed
        return self.model

    def _owner(self, stage: int) -> int:
        return plan.stage_rank(stage, self.ranks, self.info.placement)

    def _cut(self, chosen: split.Split) -> None:
        """Take ``chosen`` as the split: this rank's stages made (a deferred model: from the seed, then the
        state loaded before, if any) and their parameters noted as its own."""
        self.split = chosen
        parts = dict(split.units(self.model))
        mine = [n for s in self.mine for n in chosen.stage_units(s)]
        if self._maker is not None:
            self._maker.make(set(mine))
        for stage in self.mine:
            self.modules[stage] = nn.Sequential(*(parts[n] for n in chosen.stage_units(stage)))
        self._owned_keys = tuple(f"{n}." for n in mine)
        self.owned = [p for s in self.mine for p in self.modules[s].parameters()]
        if self._loaded is not None:
            loaded, self._loaded = self._loaded, None
            self._load_own(loaded)

    def _ensure_stages(self, sample: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """At first use: the split chosen (``auto``) or the given one checked, on rank 0, and broadcast; then
        every rank holds only its stages and builds its part of the schedule."""
        if self.schedule is not None:
            return
        topo = self.topology
        chosen = None
        if topo.rank == 0:
            try:
                chosen = self._choose(sample, labels)
            except ConfigError as exc:
                chosen = exc
        chosen = topo.broadcast_object(chosen)
        if isinstance(chosen, ConfigError):
            raise chosen
        if isinstance(chosen, traced.TracedSplit):
            self._cut_traced(chosen, sample, labels)
        else:
            if self._replay is not None:  # _replay: a chain of units after all, made whole as single makes it
                self._make(self._replay, lambda name: True)
                self._replay = None
            if self.split is None:
                self._cut(chosen)
            self._release_others()
        if topo.rank == 0:
            get_logger().info(self.split.describe([self._owner(s) for s in range(self.num_stages)]))
        if self.tp > 1:  # torchtitan's order: cut into stages, then each stage's layers split over tp
            tp_axis.split_stages(self)
        if self.sharded:
            self._shard()
        group = topo.axis_group("pp")
        self.stage_objects = [self._traced_stage(s, group) if self.is_traced else
                              TimedStage(self.modules[s], s, self.num_stages, topo.device, group=group)
                              for s in self.mine]
        for stage in self.stage_objects:  # --precision bf16-mixed: each stage's forward under autocast
            stage.autocast = self.amp.autocast
        cls = plan.torch_schedule_class(self.options.schedule)
        stages = self.stage_objects[0] if self.info.chunks == 1 else self.stage_objects
        # scale_grads off: each micro-batch's loss is already weighed by its share of the global batch
        loss_fn = self._model_loss if self.recipe.loss == "model" else self._loss
        self.schedule = cls(stages, self.options.microbatches, loss_fn=loss_fn, scale_grads=False)

    def _choose(self, sample: torch.Tensor, labels: torch.Tensor | None = None) -> split.Split | traced.TracedSplit:
        """Rank 0: the split (measured for ``auto``), after checking that the forward is the units in order.
        A deferred model's units not yet made are made one at a time for it, and returned to meta after.
        A model that is not such a chain is cut by the tracer (:mod:`.traced_run` says when)."""
        traced_error = None
        if self._replay is not None and not must_trace(self.model, split.parse_split(self.options.split_at),
                                                       self.recipe.loss):
            try:
                return self._choose_traced(sample, labels)
            except ConfigError as exc:  # _replay: not traceable; made whole, it may still be a chain of units
                traced_error = exc
                self._make(self._replay, lambda name: True)
                self._replay = None
        if self._replay is None and not must_trace(self.model, split.parse_split(self.options.split_at), self.recipe.loss):
            resident = self._maker.resident if self._maker is not None else None
            try:
                chosen = split.choose_split(self.model, sample, self.num_stages, self.options.split_at, resident=resident)
                return chosen if self.split is None else self.split
            except ConfigError as exc:
                if traced_error is not None:
                    raise traced_error from None
                if (chain_kind(self.model) or self._maker is not None) and self.split is not None:
                    raise  # (cut by --split-at before the first step: a chain it must be)
                traced_error = exc if chain_kind(self.model) or self._maker is not None else None
        try:  # not a chain of units (nanoGPT's forward adds position embeddings): the tracer cuts it
            return self._choose_traced(sample, labels)
        except ConfigError:
            if traced_error is not None:  # built as a chain of units (init_unit): its own reason first
                raise traced_error from None
            raise

    def _release_others(self) -> None:
        """Keep only this rank's stages resident: the other units' tensors are emptied in place (their
        Parameter objects stay, so the optimizer's indices remain single's) and their optimizer state is
        dropped. That state could only be a resumed checkpoint's, never updated here; kept, it would also
        overwrite the owner's when the stages' states are gathered into one."""
        mine = {id(unit) for s in self.mine for unit in self.modules[s]}
        for _, unit in split.units(self.model):
            if id(unit) in mine:
                continue
            if self.optimizer is not None:
                for param in unit.parameters():
                    self.optimizer.state.pop(param, None)
            release_unit(unit, self.topology.device)

    def _loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        task = self.recipe.task
        with self.amp.autocast():  # the loss as the other strategies compute it (in float32 under autocast)
            return task.loss(outputs, targets) / loss_divisor(self._global_units, self.replicas, task.units(targets))

    # -- the step ----------------------------------------------------------------------------------

    def train_step(self, batch: Batch, lr: float) -> StepResult:
        assert self.optimizer is not None
        opts = self.options
        size = len(batch) // opts.microbatches
        labels = self.recipe.task.model_labels(batch.inputs, batch.targets) if self.recipe.loss == "model" else None
        self._ensure_stages(self.amp.inputs(batch.inputs[:size]), labels[:size] if labels is not None else None)
        self._set_lr(lr)  # after the stages are made: --shard-dp builds the optimizer again there
        self.optimizer.zero_grad(set_to_none=True)
        self._global_units = batch.global_units if labels is None else self._model_units(batch)
        for stage in self.stage_objects:
            stage.busy, stage.sent, stage.received = 0.0, 0, 0
        losses: list[torch.Tensor] = []
        start = time.perf_counter()
        args = (self.amp.inputs(batch.inputs),) if 0 in self.mine else ()
        if self.is_traced and args:  # stage 0's arguments in the traced graph's order (inputs, labels)
            args = traced.root_args(self._traced_info, args[0], labels)
        target = batch.targets if labels is None else labels
        # --profile: "wait" is the schedule's time outside its stages' forward and backward
        with phase("wait"), plain_as_replicated(self.is_traced and self.tp > 1):
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        wall = time.perf_counter() - start
        busy = sum(stage.busy for stage in self.stage_objects)
        self.traffic.add(sum(s.sent for s in self.stage_objects), sum(s.received for s in self.stage_objects))
        self._busy, self._wall = self._busy + busy, self._wall + wall
        self._busy_total, self._wall_total = self._busy_total + busy, self._wall_total + wall
        with phase("exchange"):
            self._sync_tied()
        if self.sharded:  # reduce-scattered by FSDP; each parameter gathered once (kept until the last backward)
            moved = (self.replicas - 1) / self.replicas * self._stage_bytes
            self.traffic.add(2 * moved, 2 * moved)
        elif self.replicas > 1:
            with phase("exchange"):
                self._average_over_replicas()
        with phase("update"):
            if self.recipe.clip_grad_norm is not None:
                self._clip(self.recipe.clip_grad_norm)
            with self.phase("optimizer"):
                self._optimizer_step(self.optimizer)
        if 0 in self.mine:  # examples counted once per pipeline
            self.traffic.examples += len(batch)
        loss = torch.stack(losses).sum().detach() if self.num_stages - 1 in self.mine else None
        return StepResult(loss, len(batch))

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        opts = self.options
        inputs = self.amp.inputs(inputs)
        size = max(1, len(inputs) // opts.microbatches)
        labels = self.recipe.task.model_labels(inputs, targets) if self.recipe.loss == "model" else None
        self._ensure_stages(inputs[:size], labels[:size] if labels is not None else None)
        with self.amp.autocast():
            if self.is_traced:
                with plain_as_replicated(self.tp > 1):
                    out = self._traced_eval(inputs, targets)
                if self.sharded:  # gathered for the forward: back to this rank's shards
                    for module in self.modules.values():
                        reshard(module)
                return None if out is None else torch.stack(
                    [v.to(self.topology.device).double() for v in self.recipe.task.score(out, targets)])
            out = chain_forward(self.modules, self.num_stages, self._owner, self.me, inputs,
                                self.topology.axis_group("pp"))
            if self.sharded:  # gathered for the forward: back to this rank's shards
                for module in self.modules.values():
                    reshard(module)
            if out is None or self.topology.axis_rank("tp") > 0:  # (tp: counted once per stage)
                return None
            score = self.recipe.task.score(out, targets)
        return torch.stack([v.to(self.topology.device).double() for v in score])

    # -- metrics -----------------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        busy, wall = self._busy, self._wall
        self._busy = self._wall = 0.0
        return {**super().take_metrics(), "pp_busy_s": round(busy, 4), "pp_idle_s": round(wall - busy, 4)}

    def summary_metrics(self) -> dict[str, Any]:
        resident = sum(local(t).numel() for t in self.model.parameters() if not t.is_meta) \
            if self.model is not None else 0
        per_rank = self.trainers.all_gather_object((self._busy_total, self._wall_total, resident))
        opts = self.options
        theory = plan.theoretical_bubble(self.ranks, opts.microbatches, self.info.chunks)
        return {
            **super().summary_metrics(),
            "pipeline_schedule": opts.schedule,
            "pipeline_split": [self.split.stage_units(s) for s in range(self.num_stages)] if self.split else None,
            "rank_pp_busy_s": [round(b, 4) for b, _, _ in per_rank],
            "rank_pp_idle_s": [round(w - b, 4) for b, w, _ in per_rank],
            "rank_pp_bubble": [round(1 - b / w, 4) if w else None for b, w, _ in per_rank],
            "rank_pp_parameters": [n for _, _, n in per_rank],  # resident on each rank: its stages' only
            "pp_bubble_theoretical": round(float(theory), 4),
        }

    def describe(self) -> str:
        opts = self.options
        layout = f"{self.replicas} x " if self.replicas > 1 else ""
        shards = f", each stage sharded over its {self.replicas} replicas (fully_shard)" if self.sharded else ""
        return (f"{self.name}: {layout}{self.ranks} stage processes ({self.info.chunks} chunk(s) each){shards}, "
                f"{opts.microbatches} micro-batches, schedule {opts.schedule}; {self.topology.describe()}")


@register_strategy
class Hybrid(HybridDeclared, Pipeline):

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        if config.pipeline.shard_dp and layout.axis("dp_shard") < 2:
            raise ConfigError("--shard-dp with --dp 1 shards nothing (the one replica holds its stages whole "
                              "anyway); give --dp 2 or more, or drop --shard-dp")
        super().check(layout, config, model)
