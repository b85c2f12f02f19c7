"""``fsdp``: sharded data parallel with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

Each worker takes a slice of every global batch, as with ``sync``, but no worker holds the whole model: every
unit of the model (its top-level children, a ``ModuleList`` flattened: ``blocks.0``, ``blocks.1``, ...) and
the model itself are sharded over the workers, so each holds 1/N of the parameters, of their gradients and of
the optimizer state (ZeRO-3). A unit's parameters are all-gathered just before its forward and freed after it
(``--reshard-after-forward``, the default; off keeps them gathered until its backward: one all-gather less
per step for more memory, like ZeRO-2), gathered again for its backward, and its gradients reduce-scattered
(averaged) to their shards as soon as backward leaves it. The update is each shard's; the optimizer never
sees a whole tensor.

Equal to ``single`` on the whole batch: the slices' losses are weighed as ``sync``'s, the reduce-scatter
averages; ``--accumulate K`` defers the reduce-scatter to the last micro-batch; ``--clip-grad-norm`` clips
the norm of the whole gradient (the shards' squared norms summed over the workers). Checkpoints are written in
parts, each rank its rows (``sharded_state``), and read back by rows (``held_state``): a run resumes into any
strategy and any world size, and a resumed fsdp rank reads only the rows it holds. ``--save-model DIR`` is
written one tensor at a time (:mod:`polytrain.weights.save`); ``state_dict`` (``--save-model FILE.pt``) gathers
the whole model into rank 0's memory, one tensor at a time.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, ContextManager, Iterator

import torch
from torch import nn

from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.parallel.fsdp_config import FsdpDeclared
from polytrain.parallel.dtensor import clip, load_whole, local, whole_state
from polytrain.parallel.tp.plan import plan_for
from polytrain.parallel.tp.strategy import check_tp
from polytrain.precision import Amp, refuse_loss_scaling
from polytrain.strategies.base import Strategy, check_batch
from polytrain.strategies.registry import register_strategy
from polytrain.log import get_logger
from polytrain.models.deferred import (describe_whole_build, is_deferred, materialize, materialize_all,
                                       weights_of)
from polytrain.models.parts import retie, unit_groups, units
from polytrain.strategies.held import HeldState
from polytrain.train.heal import HEALED_ATTR, Healing


@register_strategy
class FullyShardedDataParallel(FsdpDeclared, Strategy):
    _max_norm: float | None = None

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        if layout.processes < 2:
            raise ConfigError("--strategy fsdp with 1 worker shards nothing (one worker holds the whole model "
                              "anyway); give --workers 2 or more, or use --strategy single")
        tp = layout.axis("tp")
        if layout.axis("dp_shard") < 2:
            raise ConfigError(f"--strategy fsdp with --dp-shard 1 shards nothing; give --workers {2 * tp} (--dp-shard "
                              f"2 x --tp {tp}), or use --strategy tp")
        check_batch(layout.slices, config.global_batch(layout.slices), config.train.accumulate)
        if tp > 1:
            refuse_loss_scaling(config, "fsdp --tp", "the scaler does not take the split layers' DTensor gradients")
            check_tp(config, model, tp)

    # -- the model, sharded ----------------------------------------------------------------------------

    def _materialize(self, model: nn.Module) -> nn.Module:
        return model  # unit by unit in _wrap, each sharded before the next is made

    def _wrap(self, model: nn.Module) -> nn.Module:
        if self.layout.expendable and self.topology.axis_size("tp") == 1:  # --on-failure continue (train/heal.py)
            self.healing = Healing(model, self.layout, self.topology.rank)
        if not self.topology.distributed:
            self.held_state = HeldState(self)
            return materialize_all(model).to(self.topology.device)
        # over dp_shard; HSDP over dp_replicate x dp_shard (each replica's shards, the replicas all-reduced)
        mesh = self.topology.submesh("dp_replicate", "dp_shard")
        tp = self.topology.submesh("tp")  # torchtitan's order: the tp plan's layers split, then fully_shard
        plan = plan_for(model, self.options.tp_plan) if tp is not None else None
        policy = self._policy()
        root = {**policy, "mp_policy": self._policy(root=True)["mp_policy"]} if policy else {}
        model = shard_model(model, self.topology, mesh, bool(self.options.reshard_after_forward), policy, root,
                            split=(lambda name, unit: plan.apply(unit, tp, name)) if plan is not None else None)
        self._param_bytes = sum(local(p).numel() * p.element_size() for p in model.parameters())
        if mesh.ndim == 1 and tp is None:  # checkpoints in parts: each rank writes its shards (rows over one axis)
            self.sharded_state = _Shards(self)
            self.held_state = HeldState(self)  # ... and reads only its rows of any checkpoint
        return model

    def prepare(self, model: nn.Module, make_optimizer: Any, recipe: Any = None, place: Any = None) -> nn.Module:
        model = super().prepare(model, make_optimizer, recipe, place)
        if self.topology.axis_size("tp") > 1:  # --clip-grad-norm over parameters on two meshes: clipped here
            self._max_norm, self.recipe = self.recipe.clip_grad_norm, replace(self.recipe, clip_grad_norm=None)
        return model

    def _optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._max_norm is not None:
            assert self.model is not None
            clip(self.model.parameters(), self._max_norm, self.topology.device)
        super()._optimizer_step(optimizer)

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        score = super().eval_step(inputs, targets)  # every tp rank computes it (the split layers exchange)
        return score if self.topology.axis_rank("tp") == 0 else None  # counted once per slice

    def _policy(self, root: bool = False) -> dict[str, Any]:
        """``--precision bf16-mixed`` as FSDP2 carries it out: each unit's parameters gathered in bfloat16 (half
        the bytes moved) and computed in it, gradients reduce-scattered in float32 (bfloat16 sums on gloo are
        wrong: pytorch#111131) into float32 shards the optimizer updates; the model's output in float32, so
        the loss is float32's. Other modes: nothing (the shared step runs them)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if not self._own_precision():
            return {}
        output = torch.float32 if root else None
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                  output_dtype=output)}

    def _own_precision(self) -> bool:
        return self.recipe.precision.name in self.traits.own_precision and self.topology.distributed

    def _precision_runtime(self) -> Amp:
        """The shared step's autocast and scaler, except for the mode the policy carries out (one process, which
        shards nothing, runs every mode as single does)."""
        precision = self.recipe.precision
        return Amp(precision, self.topology.device, active=not self._own_precision())

    def _grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        """``--accumulate``: gradients reduce-scattered only in the last micro-batch's backward."""
        return gradient_sync(model, enabled)

    def train_step(self, batch: Any, lr: float) -> Any:
        result = super().train_step(batch, lr)
        self._count_traffic()
        return result

    def _count_traffic(self) -> None:
        """Each step: every unit all-gathered for forward, again for backward when resharded after forward (in
        bfloat16 under the bf16-mixed policy), and its gradients reduce-scattered once (in the parameters' own
        dtype). Ring model: each rank moves (N-1)/N of the whole, per op."""
        n, replicas = self.topology.axis_size("dp_shard"), self.topology.axis_size("dp_replicate")
        moved = 0.0
        if n > 1:
            share = (n - 1) / n * self._param_bytes * n
            gathered = share / 2 if self._own_precision() else share  # float32 shards gathered as bfloat16
            gathers = 2 if self.options.reshard_after_forward else 1
            moved += gathers * gathered + share
        if replicas > 1:  # HSDP: each shard's gradients all-reduced over the replicas (a ring: 2 (R-1)/R of them)
            moved += 2 * (replicas - 1) / replicas * self._param_bytes
        if moved:
            self.traffic.add(moved, moved)

    def describe(self) -> str:
        zero = "resharded after forward (ZeRO-3)" if self.options.reshard_after_forward else \
            "kept gathered until backward (ZeRO-2-like)"
        mixed = "; bf16-mixed by FSDP's MixedPrecisionPolicy (gathered in bfloat16, reduced in float32)" \
            if self._own_precision() else ""
        replicas = self.topology.axis_size("dp_replicate")
        hsdp = f" in each of {replicas} replicas (HSDP: the replicas' gradients all-reduced)" if replicas > 1 else ""
        return f"{super().describe()}; parameters, gradients and optimizer state in " \
               f"{self.topology.axis_size('dp_shard')} shards{hsdp}, each unit's parameters {zero}{mixed}"

    # -- the whole model's state, as single saves it --------------------------------------------------

    def state_dict(self, optimizer: bool = True) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        assert self.model is not None and self.optimizer is not None
        if self.topology.axis_size("tp") > 1:  # 2-D: each tensor gathered over both axes (dtensor.full)
            model, held = whole_state(self.model, self.optimizer, optimizer)
            return {"model": model, **({"optimizer": held} if optimizer else {})} if self.trainers.is_main else None
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model = get_model_state_dict(self.model, options=full)  # collective: every rank takes part (cpu_offload:
        by_name = get_optimizer_state_dict(self.model, self.optimizer, options=full) if optimizer else None  # rank 0's)
        if not self.trainers.is_main:
            return None
        model = retie(model, self.model)  # a tied tensor one tensor, as single saves it
        if optimizer:  # the hyper-parameters as torch.optim keeps them (tuples stay tuples), the state by index
            groups = self.optimizer.state_dict()["param_groups"]
            by_name = {"state": _indexed(by_name["state"], self._names()), "param_groups": groups}
        return {"model": model, **({"optimizer": by_name} if optimizer else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        assert self.model is not None and self.optimizer is not None
        if self.topology.axis_size("tp") > 1:
            return load_whole(self.model, self.optimizer, state)
        full = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=full)
        set_optimizer_state_dict(self.model, self.optimizer, _named(state["optimizer"], self._names()), options=full)
        for live, given in zip(self.optimizer.param_groups, state["optimizer"]["param_groups"]):
            live.update({key: value for key, value in given.items() if key != "params"})  # (tuples stay tuples)

    def _names(self) -> list[str]:
        """The parameters' names in the order ``single``'s optimizer numbers them (those that train)."""
        assert self.model is not None
        return [name for name, p in self.model.named_parameters() if p.requires_grad]


def shard_group(modules: list[nn.Module], mesh: Any, **options: Any) -> None:
    """``fully_shard`` the ``modules`` as one shard group (one all-gather, one reduce-scatter; a tensor they
    share stays one tensor), if they hold a parameter that trains. A container without a forward of its own
    (an ``nn.ModuleDict``) is left to the group of the module above it."""
    from torch.distributed.fsdp import fully_shard

    modules = [m for m in modules if type(m).forward is not nn.Module.forward]
    if any(p.requires_grad for m in modules for p in m.parameters()):
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, **options)


def shard_model(model: nn.Module, topology: Any, mesh: Any, reshard: bool = True, policy: dict[str, Any] | None = None,
                root: dict[str, Any] | None = None, split: Any = None) -> nn.Module:
    """``model`` on this rank's device, each unit (its top-level children, a ``ModuleList`` flattened) and then
    the model ``fully_shard``-ed over ``mesh`` (HSDP where it is 2-D), ``split(name, unit)`` first (the tp plan's
    layers: torchtitan's order). A model on the meta device is made unit by unit, each sharded before the next
    is made, so a rank never holds more than one whole unit."""
    from torch.distributed.fsdp import fully_shard

    device = topology.device

    def shard(name: str, unit: nn.Module) -> None:
        if split is not None:
            split(name, unit)
        shard_group([unit], mesh, reshard_after_forward=reshard, **(policy or {}))

    if is_deferred(model) and weights_of(model) is not None:  # sharded on meta: each rank reads its rows
        materialize(model, device, before=shard)
    elif is_deferred(model):  # each unit made whole, sharded, then the next: never more than one whole unit
        materialize(model, device, then=shard)
    else:
        if topology.is_main and not getattr(model, HEALED_ATTR, False):  # (a heal's rebuild: whole on purpose)
            get_logger().warning(describe_whole_build(model, type(model).__name__))
        model = model.to(device)
        for group in unit_groups(units(model)):  # units sharing a tensor (tied weights): one shard group
            for name, unit in group:
                if split is not None:
                    split(name, unit)
            shard_group([unit for _, unit in group], mesh, reshard_after_forward=reshard, **(policy or {}))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **(root or {}))  # what no unit holds (the root's own)
    return model


class _Shards:
    """fsdp's checkpoint part: the rows of every parameter and of its optimizer state this rank holds."""

    def __init__(self, strategy: FullyShardedDataParallel):
        self.strategy = strategy

    def part(self) -> dict[str, Any]:
        from polytrain.train.sharded import model_part, optimizer_part

        s = self.strategy
        assert s.model is not None and s.optimizer is not None
        rank, main = s.trainers.rank, s.trainers.is_main
        return {"model": model_part(s.model.state_dict(), rank, main),
                "optimizer": optimizer_part(s.optimizer.state_dict()["state"], rank, main)}

    def skeleton(self) -> dict[str, Any]:
        from polytrain.train.integrity import signature

        s = self.strategy
        assert s.model is not None and s.optimizer is not None
        # a DTensor's shape is the whole tensor's: the signature single's checkpoint would have
        return {"model": signature(s.model.state_dict()), "param_groups": s.optimizer.state_dict()["param_groups"]}


def gradient_sync(model: Any, enabled: bool) -> ContextManager[Any]:
    """``--accumulate`` over a sharded model: its gradients reduce-scattered only where ``enabled`` (the last
    micro-batch's backward); nothing for a model FSDP does not hold."""
    return _gradient_sync(model, enabled) if hasattr(model, "set_requires_gradient_sync") else contextlib.nullcontext()


@contextlib.contextmanager
def _gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)



def _indexed(by_name: dict[str, Any], names: list[str]) -> dict[int, Any]:
    """Optimizer state keyed by parameter names, keyed as torch.optim numbers the parameters (single's)."""
    index = {name: i for i, name in enumerate(names)}
    return dict(sorted((index[n], value) for n, value in by_name.items()))


def _named(indexed: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Single's optimizer state dict keyed by parameter names (what ``set_optimizer_state_dict`` takes)."""
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in indexed["param_groups"]]
    return {"state": {names[int(i)]: value for i, value in indexed["state"].items()}, "param_groups": groups}
