"""What :class:`~polytrain.parallel.pp.strategy.Pipeline` does when its model is split by the tracer
(:mod:`.traced`) rather than as a chain of units: which path a run takes, this rank's traced stages, the
tied tensors' gradients summed over the ranks holding them, the loss of ``--loss model``, and evaluation
through the traced graph.

A run is traced when ``--loss model`` is given (the labels must reach the model's own loss on the last
stage), when ``--split-at`` names modules that are not units, or when the model is not a chain by
construction (an ``nn.Sequential``, or a class with ``init_unit``) and its forward is not its units in order.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from polytrain.errors import ConfigError
from polytrain.log import get_logger
from polytrain.models import replay
from polytrain.models.deferred import describe_whole_build
from polytrain.models.parts import tied_groups, units
from polytrain.parallel.dtensor import local
from polytrain.parallel.pp import split, traced
from polytrain.strategies.step import _model_global_units, loss_divisor


def _runs(module: nn.Module) -> bool:
    """Whether ``module`` of a traced stage has a forward of its own (a plain ``nn.Module`` only holds)."""
    return type(module).forward is not nn.Module.forward


def chain_kind(model: nn.Module) -> bool:
    """Whether ``model`` is a chain of units by construction (its units are cut without tracing)."""
    return isinstance(model, nn.Sequential) or callable(getattr(model, "init_unit", None))


def must_trace(model: nn.Module, starts: list[str] | None, loss: str) -> bool:
    """Whether the tracer cuts the model whatever its forward: ``--loss model``, or split points naming
    modules that are not the model's units."""
    units, modules = {n for n, _ in split.units(model)}, {n for n, _ in model.named_modules()}
    return loss == "model" or (starts is not None and any(s in modules and s not in units for s in starts))


class TracedRun:
    """Mixin of the pipeline strategy: the traced path (see the module docstring)."""

    _traced_info: Any = None
    _pipe: Any = None
    _owned_set: set[str] | None = None
    _ties: list[tuple[torch.Size, bool, list[str]]] = []  # a tensor tied across stages: its shape, names
    _traced_batch = 0
    _replay: Any = None  # how to build any part of a model given on the meta device (polytrain.models.replay)

    def _replay_recipe(self) -> Any:
        """The model's :func:`~polytrain.models.replay.recipe`, if it names the model's tensors as they are;
        a model changed since it was mapped (a unit option's wrapper) is made whole instead, with a warning."""
        found = replay.recipe(self.model)
        if found is None:
            return None
        names = {n for n, _ in [*self.model.named_parameters(remove_duplicate=False),
                                *self.model.named_buffers(remove_duplicate=False)]}
        if names == set(found[1]):
            return found
        if self.topology.is_main:
            get_logger().warning(describe_whole_build(self.model, type(self.model).__name__))
        self._make(found, lambda name: True)
        return None

    def _make(self, found: Any, keep: Any, names: set[str] | None = None) -> None:
        """The tensors ``keep`` accepts made with ``single``'s values (a part build), on this rank's device."""
        build, calls, state = found
        part = replay.build_part(build, calls, state, keep)
        device = self.topology.device
        if torch.device(device).type != "cpu":
            for name, tensor in [*part.named_parameters(), *part.named_buffers()]:
                if not tensor.is_meta:
                    tensor.data = tensor.data.to(device)
        replay.fill(self.model, part, names)

    def _initial_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state as ``single`` starts, on the CPU (a state asked for before the cut)."""
        if self._replay is None:
            return self._maker.initial_state()
        build, calls, state = self._replay
        return {k: v.detach().cpu() for k, v in replay.build_part(build, calls, state, lambda n: True).state_dict().items()}

    @property
    def is_traced(self) -> bool:
        return self._traced_info is not None

    def _trace_kwargs(self, labels: torch.Tensor | None) -> dict[str, Any]:
        return {"labels": labels} if labels is not None else {}

    def _choose_traced(self, sample: torch.Tensor, labels: torch.Tensor | None) -> traced.TracedSplit:
        """Rank 0: the traced split, checked by tracing it (the pipe kept for :meth:`_cut_traced`)."""
        if self.info.chunks != 1:
            raise ConfigError(f"--schedule {self.options.schedule} runs several stages per rank, which only a "
                              "model that is a chain of units can have; use gpipe or 1f1b")
        sample, labels = self._trace_sample(sample, labels)
        kwargs = self._trace_kwargs(labels)
        chosen = traced.choose(self.model, sample, kwargs, self.num_stages, split.parse_split(self.options.split_at))
        self._pipe = self._trace(chosen, sample, labels)
        return chosen

    def _on_meta(self) -> bool:
        """Whether the model waits on the meta device to be made part by part (a factory's, or by units)."""
        return self._replay is not None or getattr(self, "_maker", None) is not None

    def _trace_sample(self, sample: torch.Tensor, labels: torch.Tensor | None) -> tuple[Any, Any]:
        """The micro-batch the tracer runs: on the meta device for a model there (nothing made yet)."""
        if not self._on_meta():
            return sample, labels
        return sample.to("meta"), (labels.to("meta") if labels is not None else None)

    def _trace(self, chosen: traced.TracedSplit, sample: torch.Tensor, labels: torch.Tensor | None) -> Any:
        # a model on the meta device is traced as a copy (nothing to copy but shapes): the tracer leaves weak
        # references on what it traces, and the model's own Parameter objects take their contents later
        model = copy.deepcopy(self.model) if self._on_meta() else self.model
        pipe = traced.trace(model, sample, self._trace_kwargs(labels), chosen, self.recipe.loss, self._spec())
        if self._on_meta():
            traced.retarget(pipe, self.topology.device)
        return pipe

    def _spec(self) -> str:
        return type(self.model).__name__

    def _cut_traced(self, chosen: traced.TracedSplit, sample: torch.Tensor, labels: torch.Tensor | None) -> None:
        """Every rank: the model traced and cut as ``chosen`` says; this rank keeps its stages (the model's
        own Parameter objects) and empties every other tensor of the model and of the other stages."""
        sample, labels = self._trace_sample(sample, labels)
        pipe = self._pipe or self._trace(chosen, sample, labels)
        self._pipe = None
        self.split = traced.described(pipe, chosen, self.model)
        self._traced_info, self._traced_batch = pipe.info(), len(sample)
        names: list[set[str]] = []
        for stage in range(self.num_stages):
            module = pipe.get_stage_module(stage)
            names.append({n for n, _ in [*module.named_parameters(remove_duplicate=False),
                                         *module.named_buffers(remove_duplicate=False)]})
            if stage in self.mine:
                traced.adopt(module, self.model)
                self.modules[stage] = module
        self._owned_set = set().union(*(names[s] for s in self.mine))
        if self._on_meta():  # this rank's stages made now, with single's values; nothing else
            if self._replay is not None:
                self._make(self._replay, lambda name: name in self._owned_set, self._owned_set)
            else:  # made by units (init_unit): the units holding a tensor of this rank's stages
                self._maker.make({name for name, _ in units(self.model)
                                  if any(key.startswith(name + ".") for key in self._owned_set)})
            for stage in self.mine:  # the buffers made are new objects (a Parameter keeps its object)
                traced.adopt(self.modules[stage], self.model)
        keep = {id(t) for s in self.mine for t in [*self.modules[s].parameters(), *self.modules[s].buffers()]}
        self.owned = [p for p in self.model.parameters() if id(p) in keep]
        self._ties = []
        for group in tied_groups(self.model):
            holders = sorted({s for s in range(self.num_stages) if names[s] & set(group)})
            if len(holders) > 1:
                first = self._owner(holders[0]) == self.me
                self._ties.append((self.model.get_parameter(group[0]).shape, first, group))
        self._empty_others(pipe, keep)
        if self._loaded is not None:  # a checkpoint loaded before the cut
            loaded, self._loaded = self._loaded, None
            self._load_own(loaded)

    def _empty_others(self, pipe: Any, keep: set[int]) -> None:
        """Every tensor this rank does not train holds 0 bytes: the model's (Parameter objects kept, their
        optimizer state dropped) and the tracer's copies in the other stages."""
        device = self.topology.device
        tensors = [*self.model.parameters(), *self.model.buffers()]
        own = {id(t) for t in tensors}
        for stage in range(self.num_stages):
            if stage not in self.mine:
                module = pipe.get_stage_module(stage)
                tensors += [*module.parameters(), *module.buffers()]
        seen: set[int] = set()
        for tensor in tensors:
            if id(tensor) in keep or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            if self.optimizer is not None and isinstance(tensor, nn.Parameter):
                self.optimizer.state.pop(tensor, None)
            empty = torch.empty(0, dtype=tensor.dtype, device=device)
            if tensor.is_meta and id(tensor) not in own:
                continue  # the tracer's copy of a model on the meta device: holds nothing
            if tensor.is_meta and isinstance(tensor, nn.Parameter):  # Parameter object kept (the optimizer's)
                torch.utils.swap_tensors(tensor, nn.Parameter(empty, requires_grad=tensor.requires_grad))
            elif not tensor.is_meta:
                tensor.data = empty

    def _traced_stage(self, stage: int, group: Any) -> Any:
        return traced.TimedTracedStage(self.modules[stage], stage, self._traced_info, self.topology.device,
                                       group=group)

    # -- the step ----------------------------------------------------------------------------------

    def _model_units(self, batch: Any) -> int:
        return _model_global_units(self.recipe.task, batch, self.replicas)

    def _model_loss(self, outputs: Any, labels: torch.Tensor) -> torch.Tensor:
        """``--loss model``: the model's own mean loss on a micro-batch (the first of the last stage's
        outputs), weighed by its share of the global batch's units."""
        task = self.recipe.task
        with self.amp.autocast():
            return outputs[0] / loss_divisor(self._global_units, self.replicas, task.model_units(labels))

    def _sync_tied(self) -> None:
        """Each tensor tied across stages: its gradients summed over the pipeline's ranks (a rank that holds
        no copy adds zeros), so every copy takes the same update as the one tensor of ``single``. Sharded
        (``--shard-dp``), each rank sums its dp shard, the same rows on each rank of a pipeline."""
        if not self._ties:
            return
        device = self.topology.device
        grads = []
        for shape, _, group in self._ties:
            param = self.model.get_parameter(group[0])
            if param.numel() > 0:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(local(param.grad))
            else:
                grads.append(torch.zeros(self._tied_rows(shape), dtype=param.dtype, device=device))
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.topology.axis_group("pp"))
        self.traffic.all_reduce(flat.numel() * flat.element_size(), self.ranks)
        for (_, _, group), grad, summed in zip(self._ties, grads, _unflatten_dense_tensors(flat, grads)):
            if self.model.get_parameter(group[0]).numel() > 0:
                grad.copy_(summed)

    def _tied_rows(self, shape: torch.Size) -> torch.Size:
        """The shape of this rank's part of a tied tensor of ``shape``: all of it, or its dp shard (FSDP's
        rows: ``torch.chunk``) under ``--shard-dp``."""
        if not getattr(self, "sharded", False):
            return shape
        chunks = torch.empty(shape, device="meta").chunk(self.topology.axis_size("dp_shard"))
        rank = self.topology.axis_rank("dp_shard")  # (FSDP's shards are over dp_shard; HSDP replicates them)
        return chunks[rank].shape if rank < len(chunks) else torch.Size((0, *shape[1:]))

    def _counted_once(self) -> set[int]:
        """The ids of tied parameters whose gradient another rank counts in the norm (not this one)."""
        return {id(self.model.get_parameter(group[0])) for _, first, group in self._ties if not first}

    def _stage_parts(self, stage: int) -> tuple[list[tuple[str, nn.Module]], set[nn.Parameter]]:
        """The model's units that traced stage ``stage`` runs (its modules of those names), in order, and the
        parameters that a module it never runs holds too (the tracer leaves a tied tensor's other module on
        a stage as a plain holder: nanoGPT's ``lm_head`` beside ``transformer.wte``), which the stage's own
        shard group must not take a second time."""
        module = self.modules[stage]
        held = dict(module.named_modules())
        parts = [(name, held[name]) for name, _ in units(self.model) if name in held and _runs(held[name])]
        in_parts = {p for _, part in parts for p in part.parameters()}
        holders = {p for m in held.values() if not _runs(m) for p in m.parameters(recurse=False)}
        return parts, holders & in_parts

    def _adopt_shards(self, before: dict[int, dict[str, nn.Parameter]]) -> None:
        """After ``fully_shard`` of traced stages (``before``: each stage's parameters by name, the model's own
        objects): every name of the model and of the stages holding one of those objects holds its sharded
        Parameter instead, so a tied tensor keeps one object and the optimizer built over the model sees
        the shards."""
        new: dict[int, nn.Parameter] = {}
        for stage, params in before.items():
            now = dict(self.modules[stage].named_parameters(remove_duplicate=False))
            new.update({id(old): now[name] for name, old in params.items() if now.get(name) is not old})
        for root in [self.model, *(self.modules[s] for s in self.mine)]:
            for module in root.modules():
                for key, param in module._parameters.items():
                    if param is not None and id(param) in new:
                        module._parameters[key] = new[id(param)]

    # -- evaluation --------------------------------------------------------------------------------

    def _traced_eval(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """The logits of the whole batch on the last stage's rank (None elsewhere): pieces of the traced
        micro-batch's size (the graph's shapes are fixed), the last padded with its first row and cut back."""
        labels = self.recipe.task.model_labels(inputs, targets) if self.recipe.loss == "model" else None
        size, pieces = self._traced_batch, []
        for start in range(0, len(inputs), size):
            x = inputs[start:start + size]
            y = labels[start:start + size] if labels is not None else None
            real = len(x)
            if real < size:
                x = torch.cat([x, x[:1].expand(size - real, *x.shape[1:])])
                y = torch.cat([y, y[:1].expand(size - real, *y.shape[1:])]) if y is not None else None
            root = traced.root_args(self._traced_info, x, y)
            out = traced.dag_forward(self._traced_info, self.modules, self._owner, self.me, root,
                                     self.topology.axis_group("pp"), self.topology.device)
            if out is not None:
                logits = out[1] if isinstance(out, (tuple, list)) else out
                pieces.append(logits[:real])
        return torch.cat(pieces) if pieces else None


def plan_split(config: Any, layout: Any) -> traced.TracedSplit | None:
    """For ``polytrain plan``: the split the tracer would make of ``config``'s model, traced on the meta
    device (nothing allocated; ``auto`` balances the layers' parameters, as a run does for a model it builds
    on the meta device); None for a model cut as a chain of units. One ConfigError line where a run would
    refuse the split."""
    from polytrain.data.registry import data_of
    from polytrain.models.registry import meta_build, model_name
    from polytrain.parallel.pp import plan
    from polytrain.tasks import get_task

    data = data_of(config)
    name = model_name(config, data)
    model = meta_build(name, config.model.model_args, data)
    opts, loss = config.pipeline, config.train.loss
    starts = split.parse_split(opts.split_at)
    if chain_kind(model) and not must_trace(model, starts, loss):
        return None
    stages = layout.axis("pp") * plan.schedule_info(opts.schedule).chunks
    micro = max(1, config.global_batch(layout.slices) // layout.axis("dp") // opts.microbatches)
    x, y = data.shape_example()
    sample = torch.as_tensor(x).unsqueeze(0).expand(micro, *torch.as_tensor(x).shape).to("meta")
    kwargs = {}
    if loss == "model":
        targets = torch.as_tensor(y).unsqueeze(0).expand(micro, *torch.as_tensor(y).shape).to("meta")
        kwargs["labels"] = get_task(data.task).model_labels(sample, targets)
    chosen = traced.choose(model, sample, kwargs, stages, starts)
    return traced.described(traced.trace(model, sample, kwargs, chosen, loss, name), chosen, model)
