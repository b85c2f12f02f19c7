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
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from polytrain.data.batches import Batch
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.log import get_logger
from polytrain.models import replay
from polytrain.models.deferred import describe_whole_build, is_deferred
from polytrain.models.parts import retie, unit_groups
from polytrain.parallel.fsdp import shard_group
from polytrain.phases import phase
from polytrain.precision import refuse_loss_scaling
from polytrain.strategies.base import Strategy, check_batch
from polytrain.strategies.registry import register_strategy
from polytrain.parallel.dtensor import average, full, like, local, rebuild_optimizer, squared_norm
from polytrain.parallel.pp import plan, split, traced
from polytrain.parallel.pp.config import HybridDeclared, PipelineConfig, PipelineDeclared
from polytrain.parallel.pp.transport import check_transport
from polytrain.parallel.pp.traced_run import TracedRun, chain_kind, must_trace
from polytrain.parallel.pp.build import UnitMaker, release_unit
from polytrain.parallel.pp.stages import TimedStage, chain_forward
from polytrain.strategies.step import StepResult, loss_divisor
from polytrain.tasks import check_takes_labels
from polytrain.parallel.tp import axis as tp_axis


@register_strategy
class Pipeline(PipelineDeclared, TracedRun, Strategy):

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
                check_split(model, stages, opts.split_at)
            elif layout.axis("tp") > 1 and must_trace(model, starts, config.train.loss):
                raise ConfigError(tp_axis.TRACED)  # (any other model is known to be a chain or not at its first step)
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
            self._cut(_named_split(self.model, self.num_stages, opts.split_at))  # no sample needed
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

    def _shard(self) -> None:
        """``--shard-dp``, at first use (after rank 0 has run the units whole to check the forward): each unit
        of this rank's stages, then the stage, ``fully_shard``-ed over the dp axis. The parameters are kept
        gathered from a step's first forward to its last backward (no gather per micro-batch); the stage's
        gradient reduce-scatter waits for the last micro-batch (torch's ``PipelineStage`` turns the sync off
        until then) and reshards. fully_shard replaces the Parameter objects, so the optimizer is built
        again over the model's parameters, in ``single``'s order, and given the state it held (a resumed
        checkpoint's), cut into this rank's shards."""
        from torch.distributed.fsdp import fully_shard

        assert self.optimizer is not None
        mesh = self.topology.submesh("dp_replicate", "dp_shard")  # HSDP where there are replicas too
        before = {s: dict(self.modules[s].named_parameters(remove_duplicate=False)) for s in self.mine}
        for stage in self.mine:
            module = self.modules[stage]
            parts, ignored = self._stage_parts(stage) if self.is_traced else \
                (list(zip(self.split.stage_units(stage), module)), set())
            for group in unit_groups(parts):  # units sharing a tensor (tied weights): one shard group
                shard_group([unit for _, unit in group], mesh, reshard_after_forward=False)
            fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
        if self.is_traced:  # the traced stages' modules are not the model's: its names take their shards
            self._adopt_shards(before)
        self.owned = [p for s in self.mine for p in self.modules[s].parameters()]
        self._stage_bytes = sum(p.numel() * p.element_size() for p in self.owned)
        self.optimizer = rebuild_optimizer(self.model, self.optimizer, self._make_optimizer)

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
                chosen = choose_split(self.model, sample, self.num_stages, self.options.split_at, resident=resident)
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
        with phase("wait"):  # --profile: the schedule's time outside its stages' forward and backward
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

    def _average_over_replicas(self) -> None:
        grads = [local(p.grad) for p in self.owned if p.grad is not None]  # (tp: each rank's part)
        self.traffic.all_reduce(average(grads, self.topology.axis_group("dp"), self.replicas), self.replicas)

    def _clip(self, max_norm: float) -> None:
        """clip_grad_norm_ over all stages: the squared norms of each rank's gradients summed over pp (and over
        dp, sharded: each replica holds 1/D of its stages' gradients)."""
        more = (self.topology.axis_group("pp"),) if self.ranks > 1 else ()
        if self.tp > 1 and self.sharded:  # over two meshes: each gradient's pieces summed over the axes it is cut
            squared = squared_norm([p.grad for p in self.owned if p.grad is not None], self.topology.device)
            for group in more:
                dist.all_reduce(squared, group=group)
            coef = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
            for p in self.owned:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
            return None
        if self.tp > 1:  # the split layers' squared norms summed over tp, the whole ones counted once
            return tp_axis.clip_grads(self.owned, max_norm, self.topology.axis_group("tp"), more)
        skip = self._counted_once()  # a tied tensor's gradient counted on one of its ranks
        grads = [local(p.grad) for p in self.owned if p.grad is not None and id(p) not in skip]
        norms = [torch.linalg.vector_norm(g, 2) for g in grads]
        squared = (torch.stack(norms) ** 2).sum() if norms else torch.zeros((), device=self.topology.device)
        if self.sharded:
            dist.all_reduce(squared, group=self.topology.axis_group("dp_shard"))
        if self.ranks > 1:
            dist.all_reduce(squared, group=self.topology.axis_group("pp"))
        coef = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
        for p in self.owned:
            if p.grad is not None:
                local(p.grad).mul_(coef)

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        opts = self.options
        inputs = self.amp.inputs(inputs)
        size = max(1, len(inputs) // opts.microbatches)
        labels = self.recipe.task.model_labels(inputs, targets) if self.recipe.loss == "model" else None
        self._ensure_stages(inputs[:size], labels[:size] if labels is not None else None)
        with self.amp.autocast():
            if self.is_traced:
                out = self._traced_eval(inputs, targets)
                if self.sharded:  # gathered for the forward: back to this rank's shards
                    for module in self.modules.values():
                        _reshard(module)
                return None if out is None else torch.stack(
                    [v.to(self.topology.device).double() for v in self.recipe.task.score(out, targets)])
            out = chain_forward(self.modules, self.num_stages, self._owner, self.me, inputs,
                                self.topology.axis_group("pp"))
            if self.sharded:  # gathered for the forward: back to this rank's shards
                for module in self.modules.values():
                    _reshard(module)
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

    # -- the whole model's state -------------------------------------------------------------------

    def _mine(self, key: str) -> bool:
        if self._owned_set is not None:  # traced: the stages' own names
            return key in self._owned_set
        return key.startswith(self._owned_keys)

    def _whole_model(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on the trainers' rank 0 (None elsewhere): each stage's tensors
        gathered from the first replica. Collective."""
        if self.split is None:  # not cut yet: a whole model is the same on every rank; a deferred one is unmade
            if not self.trainers.is_main:
                return None
            if self._maker is None and self._replay is None:
                return self.model.state_dict()
            return dict(self._loaded["model"]) if self._loaded is not None else self._initial_state()
        whole = self.model.state_dict()
        mine = {k: full(v).detach().cpu() for k, v in whole.items() if self._mine(k)}  # (sharded: collective)
        parts = self.trainers.all_gather_object(mine if self.topology.axis_rank("dp") == 0 else {})
        if not self.trainers.is_main:
            return None
        for part in parts:
            whole.update(part)
        return retie(whole, self.model)

    def _optimizer_state(self) -> dict[str, Any]:
        """This rank's optimizer state dict (indices the whole model's): the one loaded into a deferred model
        not cut yet, which holds no state of its own."""
        assert self.optimizer is not None
        if self.split is None and (self._maker is not None or self._replay is not None) and self._loaded is not None:
            return self._loaded["optimizer"]
        state = self.optimizer.state_dict()
        if not self.sharded and self.tp == 1:  # (tp: each split tensor's state gathered whole)
            return state
        whole = {i: {k: full(v).cpu() if isinstance(v, DTensor) else v for k, v in per.items()}
                 for i, per in state["state"].items()}  # gathered over dp, in the same order on every replica
        return {**state, "state": whole}

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        model = self._whole_model()
        if not optimizer:
            return None if model is None else {"model": model}
        optimizer = self._optimizer_state()  # indices are the whole model's; each rank holds its stages'
        states = self.trainers.all_gather_object(optimizer["state"] if self.topology.axis_rank("dp") == 0 else {})
        if model is None:
            return None
        merged: dict[int, Any] = {}
        for part in states:
            merged.update(part)
        return {"model": model, "optimizer": {**optimizer, "state": dict(sorted(merged.items()))}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load the whole model's state (every rank gets all of it): a rank takes its stages' tensors and
        optimizer state; a deferred model not cut yet keeps the state until its stages are made."""
        if self.split is not None:
            self._load_own(state)
        elif self._maker is not None or self._replay is not None:
            self._loaded = state
        else:
            super().load_state_dict(state)

    def _load_own(self, state: dict[str, Any]) -> None:
        """This rank's stages' tensors and optimizer state from the whole model's ``state``."""
        assert self.optimizer is not None
        model = state["model"]
        expected = set(self.model.state_dict())
        if set(model) != expected:
            missing, unexpected = sorted(expected - set(model)), sorted(set(model) - expected)
            raise RuntimeError(f"loading the model's state: missing keys {missing}, unexpected keys {unexpected}")
        live = self.model.state_dict()
        self.model.load_state_dict({k: like(v, live[k]) for k, v in model.items() if self._mine(k)}, strict=False)
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        owned = {id(p) for p in self.owned}
        mine = {i for i, p in enumerate(params) if id(p) in owned}
        optimizer = state["optimizer"]
        own = {k: {key: like(value, params[int(k)]) if torch.is_tensor(value) and key != "step" else value
                   for key, value in per.items()}
               for k, per in optimizer["state"].items() if int(k) in mine}
        self.optimizer.load_state_dict({**optimizer, "state": own})

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


def _reshard(module: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


def check_split(model: nn.Module, stages: int, split_at: str) -> list[str]:
    names = [name for name, _ in split.units(model)]
    split.check_splittable(names, stages, f"--stages/--schedule ({stages} stages in all)")
    starts = split.parse_split(split_at)
    if starts is not None:
        split.cuts_from_names(names, starts, stages)
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ConfigError(f"the model holds tensors outside its units ({', '.join(own)}); a pipeline splits "
                          "only models whose forward is their children in order")
    return names


def choose_split(model: nn.Module, sample: torch.Tensor, stages: int, split_at: str,
                 resident: Any = None) -> split.Split:
    """Check on ``sample`` that the model's forward is its units in order, then cut where ``split_at`` says,
    or where the cost measured on ``sample`` is balanced (``auto``); the model and the RNG are left as they
    were, so training is unchanged. ``resident``: see :func:`.split.measure` (a model made unit by unit)."""
    names = check_split(model, stages, split_at)
    starts = split.parse_split(split_at)
    ms, same = split.measure(model, sample, timed=starts is None, resident=resident)
    if not same:
        raise ConfigError("the model's forward is not its units applied in order "
                          f"({', '.join(names)}); a pipeline can split only such models")
    cuts = split.cuts_from_names(names, starts, stages) if starts else split.balanced_cuts(ms, stages)
    return _split(model, names, cuts, ms, "--split-at" if starts else "measured")


def _named_split(model: nn.Module, stages: int, split_at: str) -> split.Split:
    """The split ``--split-at UNITS`` names, without running the model."""
    names = check_split(model, stages, split_at)
    cuts = split.cuts_from_names(names, split.parse_split(split_at), stages)
    return _split(model, names, cuts, [0.0] * len(names), "--split-at")


def _split(model: nn.Module, names: list[str], cuts: list[int], ms: list[float], how: str) -> split.Split:
    params = tuple(sum(p.numel() for p in unit.parameters()) for _, unit in split.units(model))
    return split.Split(tuple(names), tuple(cuts), params, tuple(ms), how)
