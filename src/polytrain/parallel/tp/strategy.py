"""``tp``: tensor parallel (Megatron-style) with ``torch.distributed.tensor.parallel``, data parallel around it.

``--workers W --tp T`` starts W processes on a ``dp x tp`` DeviceMesh (W/T replicas of T ranks). In each
replica the layers the tensor-parallel plan names (:mod:`.plan`) are split over its T ranks by
``parallelize_module`` (``ColwiseParallel``/``RowwiseParallel``: DTensor parameters, one all-reduce of the
activations per colwise/rowwise pair in forward and one in backward); every other layer is whole on each
rank and computes the same values there. The T ranks of a replica take the same slice of each global batch;
the replicas average their gradients (one all-reduce of each rank's local gradients over ``dp``).

Equal to ``single`` on the whole batch. A model built on the meta device is materialised one unit at a time
and split at once, so a rank never holds more than one whole unit beside its parts. ``--clip-grad-norm``
clips the whole model's norm: the split parameters' squared norms summed over ``tp``, the whole ones counted
once. Checkpoints and ``--save-model`` hold the whole model and optimizer state as ``single`` saves them
(each split tensor gathered with ``full_tensor``), so a run resumes into any strategy and back.

The same split is the ``tp`` axis of ``pipeline``/``hybrid`` (each stage's layers split over its T ranks:
:func:`split_layers`, :func:`clip_grads`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.log import get_logger
from polytrain.models.deferred import describe_whole_build, is_deferred, materialize
from polytrain.models.parts import retie, tie_again, tied_groups
from polytrain.precision import refuse_loss_scaling
from polytrain.strategies.held import HeldState
from polytrain.strategies.base import Strategy, check_batch
from polytrain.strategies.registry import register_strategy
from polytrain.parallel.dtensor import average, is_split, load_whole, local, whole_state
from polytrain.parallel.tp.config import TensorParallelConfig, TensorParallelDeclared
from polytrain.parallel.tp.plan import TensorPlan, plan_for


@register_strategy
class TensorParallel(TensorParallelDeclared, Strategy):

    def __init__(self, topology: Any, options: TensorParallelConfig | None = None, layout: Layout | None = None):
        if not topology.distributed:
            raise ConfigError("--strategy tp splits layers over --tp processes; it cannot run in one process")
        super().__init__(topology, options, layout)
        self.held_state = HeldState(self)  # a resume reads each rank's block of the split layers
        self.plan: TensorPlan | None = None
        self._max_norm: float | None = None

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        tp = layout.axis("tp")
        if tp < 2:
            raise ConfigError("--strategy tp with --tp 1 splits nothing; give --tp 2 or more, or use --strategy sync")
        check_batch(layout.slices, config.global_batch(layout.slices), config.train.accumulate)
        refuse_loss_scaling(config, cls.name, "the scaler does not take the split layers' DTensor gradients")
        check_tp(config, model, tp)

    # -- the model, split --------------------------------------------------------------------------

    def _materialize(self, model: nn.Module) -> nn.Module:
        return model  # unit by unit in _wrap, each split before the next is made

    def _wrap(self, model: nn.Module) -> nn.Module:
        self.plan = plan_for(model, self.options.tp_plan)
        self.plan.check(model, self.topology.axis_size("tp"))  # (a factory the launcher could not build: here)
        mesh = self.topology.mesh["tp"]
        if is_deferred(model):  # each unit made whole, split, then the next
            return materialize(model, self.topology.device, then=lambda name, unit: self.plan.apply(unit, mesh, name))
        if self.topology.is_main:
            get_logger().warning(describe_whole_build(model, type(model).__name__))
        ties = tied_groups(model)
        model = model.to(self.topology.device)
        self.plan.apply(model, mesh)
        tie_again(model, ties)  # a tied tensor split alike under its names (plan.check): one Parameter again
        return model

    @contextlib.contextmanager
    def _grad_sync(self, model: nn.Module, enabled: bool) -> Iterator[None]:
        """After the last micro-batch's backward: each rank's local gradients averaged over the replicas."""
        yield
        replicas = self.trainers.axis_size("dp")
        if enabled and replicas > 1:
            grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
            self.traffic.all_reduce(average(grads, self.trainers.axis_group("dp"), replicas), replicas)

    def prepare(self, model, make_optimizer, recipe=None, place=None):
        model = super().prepare(model, make_optimizer, recipe, place)
        # --clip-grad-norm over the split layers: clipped here (clip_grads), not by the shared step
        self._max_norm, self.recipe = self.recipe.clip_grad_norm, replace(self.recipe, clip_grad_norm=None)
        return model

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._max_norm is not None:
            assert self.model is not None
            clip_grads(list(self.model.parameters()), self._max_norm, self.topology.axis_group("tp"))
        super()._optimizer_step(optimizer)

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        score = super().eval_step(inputs, targets)  # every tp rank computes it (the split layers exchange)
        return score if self.topology.axis_rank("tp") == 0 else None  # counted once per replica

    def describe(self) -> str:
        dp, tp = self.topology.axis_size("dp"), self.topology.axis_size("tp")
        replicas = f"{dp} replicas x " if dp > 1 else ""
        split = len(self.plan.resolve(self.module)) if self.plan is not None else 0
        return f"{self.name}: {replicas}{tp} tensor-parallel ranks, {split} layers split " \
               f"({self.plan.source if self.plan else ''}); {self.topology.describe()}"

    # -- the whole model's state, as single saves it --------------------------------------------------

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        assert self.model is not None and self.optimizer is not None
        model, state = whole_state(self.model, self.optimizer, optimizer)  # (collective: tp)
        model = retie(model, self.model)  # a tied tensor one tensor, as single saves it
        if not self.trainers.is_main:
            return None
        return {"model": model, **({"optimizer": state} if optimizer else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.model is not None and self.optimizer is not None
        load_whole(self.model, self.optimizer, state)


def check_tp(config: Any, model: nn.Module | None, tp: int) -> TensorPlan | None:
    """Before launch: the plan ``--tp-plan`` gives (the model's own for ``auto``) splits the model over ``tp``
    ranks (one ConfigError line if not). The model is built on the meta device when named, for the data's
    shape where the factory needs it (one that loads weights); one that cannot be built there at all is checked
    in the workers instead (which check every model again)."""
    if tp < 2:
        return None
    name = config.model.model
    if model is None and name != "auto":
        from polytrain.models.registry import meta_model

        model = meta_model(config, with_data=True)
    if model is None:
        return None
    plan = plan_for(model, config.tp.tp_plan, name)
    plan.check(model, tp)
    return plan


def split_layers(modules: list[tuple[str, nn.Module]], plan: TensorPlan, mesh: Any) -> int:
    """The plan's layers of each ``(name, module)`` (a unit or a stage, named as in the whole model) split over
    the 1-D ``mesh``; returns how many."""
    return sum(plan.apply(module, mesh, name) for name, module in modules)


def clip_grads(params: list[torch.Tensor], max_norm: float, tp_group: Any, more: tuple[Any, ...] = ()) -> None:
    """``clip_grad_norm_`` of the whole model from each rank's gradients: the split parameters' squared local
    norms summed over ``tp_group``, the whole ones (a rowwise layer's bias: a replicated DTensor) counted once; both then summed over the
    groups in ``more`` (pipeline stages)."""
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    split = [g.to_local() for g in grads if is_split(g)]
    whole = [local(g) for g in grads if not is_split(g)]
    squared = torch.zeros(2, device=device)
    if split:
        squared[0] = torch.stack([torch.linalg.vector_norm(g, 2) for g in split]).square().sum()
    if whole:
        squared[1] = torch.stack([torch.linalg.vector_norm(g, 2) for g in whole]).square().sum()
    if tp_group is not None:
        part = squared[:1].clone()
        dist.all_reduce(part, group=tp_group)
        squared[0] = part[0]
    total = squared.sum()
    for group in more:
        dist.all_reduce(total, group=group)
    coef = torch.clamp(max_norm / (total.sqrt() + 1e-6), max=1.0)
    for g in split + whole:
        g.mul_(coef)
