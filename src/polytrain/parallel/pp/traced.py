"""Pipelining a model that is not a chain of units (a Hugging Face decoder, say), through
``torch.distributed.pipelining``'s tracer: the model's forward is exported as one graph (``pipeline()`` with
a ``SplitPoint.BEGINNING`` at each module that starts a stage) and cut there. A stage may then take several
tensors (hidden states, position ids, the labels of ``--loss model``) from any earlier stage; torch's traced
``_PipelineStage`` sends each where it is used.

Split points are module names (``--split-at transformer.h.2``, several separated by commas) or ``auto``:
the items of the model's longest ``nn.ModuleList`` (its layers), cut where their measured forward times,
with what runs before the first layer and after the last counted on the first and the last, are balanced.

What the tracer is given: the model's forward on one micro-batch, with ``use_cache=False`` where the
forward takes it (a key/value cache is no training output), and for ``--loss model`` the labels as a keyword;
its output reduced to the logits (``--loss task``) or to ``(loss, logits)`` (``--loss model``), read from an
output object as :func:`polytrain.tasks.outputs_of` reads it. Each rank traces the same model on the same
micro-batch, so all cut alike. The stages' parameters are the model's own ``Parameter`` objects (so the
optimizer's indices stay ``single``'s); a tensor tied across stages (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``) is the same object on each rank that holds a stage using it, and its gradient is
summed over those ranks before the update, so the copies stay equal.
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline
from torch.distributed.pipelining._IR import annotate_split_points
from torch.distributed.pipelining.stage import _PipelineStage
from torch.utils._pytree import tree_map

from polytrain.errors import ConfigError
from polytrain.parallel.pp import split
from polytrain.parallel.pp.stages import StageTiming, recv_activation, send_activation
from polytrain.tasks import model_loss_of, outputs_of


class TimedTracedStage(StageTiming, _PipelineStage):
    """The tracer's ``_PipelineStage`` with its compute timed and its bytes counted."""


def layers(model: nn.Module) -> tuple[str, list[str]]:
    """The model's longest ``nn.ModuleList`` (its layers): its name and its items' names; or, where its
    units (:func:`polytrain.models.parts.units`: its children, a ``ModuleList`` as its items) are more, those."""
    best: tuple[str, list[str]] = ("", [])
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best[1]):
            best = (name, [f"{name}.{i}" if name else str(i) for i in range(len(module))])
    children = [name for name, _ in split.units(model, nested=False)]
    return ("its units", children) if len(children) > len(best[1]) else best


def _hint(model: nn.Module) -> str:
    name, items = layers(model)
    if items:
        return f"its layers {items[0]} .. {items[-1]}"
    return "its modules " + ", ".join(n for n, _ in model.named_children())


def check_starts(model: nn.Module, starts: list[str], stages: int) -> None:
    """``--split-at`` module names for the tracer: one ConfigError line if wrong (before the model runs)."""
    if len(starts) != stages - 1:
        raise ConfigError(f"--split-at {','.join(starts)}: {stages} stages need {stages - 1} split point(s), "
                          f"got {len(starts)}")
    order = [n for n, _ in model.named_modules() if n]
    for start in starts:
        if start not in order:
            raise ConfigError(f"--split-at {start}: the model has no module of that name; name the modules that "
                              f"start stages 1.. ({_hint(model)})")
    where = [order.index(s) for s in starts]
    if where != sorted(set(where)):
        raise ConfigError(f"--split-at {','.join(starts)}: split points must be distinct and in the model's "
                          "order of modules")


def check_auto(model: nn.Module, stages: int) -> None:
    name, items = layers(model)
    if len(items) < stages:
        raise ConfigError(f"--split-at auto: {stages} stages but the model's longest list of layers "
                          f"({name or 'none'}) has {len(items)}; use fewer stages or name the split points "
                          "(--split-at MODULE,...)")


def measure_layers(model: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any],
                   repeats: int = 3) -> tuple[list[str], list[float]]:
    """The layers' names and each one's forward milliseconds (median of ``repeats`` after a warm-up), with
    what runs before the first layer added to it and what runs after the last added to that one. The
    model's modes, buffers, gradients and the RNG are left as they were."""
    list_name, items = layers(model)
    stamps: list[tuple[int, str, float]] = []
    hooks = []
    for index, item in enumerate(items):
        module = model.get_submodule(item)
        hooks.append(module.register_forward_pre_hook(lambda *_, i=index: stamps.append((i, "in", time.perf_counter()))))
        hooks.append(module.register_forward_hook(lambda *_, i=index: stamps.append((i, "out", time.perf_counter()))))
    rounds: list[list[float]] = []
    try:
        with split._undisturbed(model, inputs.device), torch.no_grad():
            model.train()
            for round_ in range(repeats + 1):
                stamps.clear()
                start = time.perf_counter()
                _call(model, inputs, kwargs)
                end = time.perf_counter()
                begins = {i: t for i, kind, t in stamps if kind == "in"}
                ends = {i: t for i, kind, t in stamps if kind == "out"}
                ms = [(ends[i] - begins[i]) * 1e3 for i in range(len(items))]
                ms[0] += (begins[0] - start) * 1e3
                ms[-1] += (end - ends[len(items) - 1]) * 1e3
                if round_:
                    rounds.append(ms)
    finally:
        for hook in hooks:
            hook.remove()
    return items, [statistics.median(r[i] for r in rounds) for i in range(len(items))]


def _call(model: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any]) -> Any:
    extra = {"use_cache": False} if _takes(model, "use_cache") else {}
    return model(inputs, **extra, **kwargs)


def _takes(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class TracedSplit:
    """Where the tracer cuts (plain data, broadcast from rank 0): the modules starting stages 1.., and per
    stage the layers (or top-level modules) it holds, its parameters and its measured forward ms."""

    starts: tuple[str, ...]
    how: str  # "measured", "parameters" (auto on a model on the meta device) or "--split-at"
    stage_names: tuple[tuple[str, ...], ...] = ()
    stage_params: tuple[int, ...] = ()
    stage_ms: tuple[float, ...] = ()

    def stage_units(self, stage: int) -> list[str]:
        return list(self.stage_names[stage]) if self.stage_names else []

    def describe(self, stage_rank: list[int]) -> str:
        timed = self.how == "measured"
        what = {"measured": "forward ms measured on one micro-batch",
                "parameters": "balanced by parameters: the model was built on the meta device"}.get(self.how, "not timed")
        lines = [f"pipeline split (traced, {self.how}; {what}; stages start at {', '.join(self.starts)}):"]
        for stage, names in enumerate(self.stage_names):
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            ms = f", {self.stage_ms[stage]:.2f} ms" if timed and self.stage_ms else ""
            lines.append(f"  stage {stage} (rank {stage_rank[stage]}): {span} ({len(names)} modules), "
                         f"{self.stage_params[stage]:,} parameters{ms}")
        return "\n".join(lines)


def choose(model: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any], stages: int,
           starts: list[str] | None) -> TracedSplit:
    """The split ``--split-at`` names, or the measured one (``starts`` None)."""
    if starts is not None:
        check_starts(model, starts, stages)
        return TracedSplit(tuple(starts), "--split-at")
    check_auto(model, stages)
    if any(p.is_meta for p in model.parameters()):  # nothing to time: balanced by parameters instead
        items, costs = layer_parameters(model)
        cuts = split.balanced_cuts([float(c) for c in costs], stages)
        return TracedSplit(tuple(items[c] for c in cuts), "parameters")
    items, ms = measure_layers(model, inputs, kwargs)
    cuts = split.balanced_cuts(ms, stages)
    per = [sum(ms[i] for i in g) for g in split.groups(cuts, len(items))]
    return TracedSplit(tuple(items[c] for c in cuts), "measured", stage_ms=tuple(per))


def layer_parameters(model: nn.Module) -> tuple[list[str], list[int]]:
    """The layers' names and parameters, with the parameters outside them counted on the first layer (those
    before it in the model's order) or the last (those after it)."""
    _, items = layers(model)
    counts = [0] * len(items)
    seen_layer = False
    for name, param in model.named_parameters():
        index = next((i for i, item in enumerate(items) if name.startswith(item + ".")), None)
        if index is not None:
            seen_layer = True
        counts[index if index is not None else (-1 if seen_layer else 0)] += param.numel()
    return items, counts


def retarget(pipe: Any, device: torch.device) -> None:
    """A pipe traced on the meta device made to run on ``device``: every device its graphs name (a tensor
    made inside the forward, a checked or converted one) becomes ``device``."""
    def fix(value: Any) -> Any:
        return torch.device(device) if isinstance(value, torch.device) and value.type == "meta" else value

    def retarget_module(root: nn.Module) -> None:
        for module in root.modules():  # the stage's graph and those it calls
            graph = getattr(module, "graph", None)
            if isinstance(graph, torch.fx.Graph):
                for node in graph.nodes:
                    node.args, node.kwargs = tree_map(fix, node.args), tree_map(fix, node.kwargs)
                    if isinstance(node.target, Region):
                        retarget_module(node.target.graph_module)
                if isinstance(module, torch.fx.GraphModule):  # (an InterpreterModule runs its graph as it is)
                    module.recompile()

    for stage in range(pipe.num_stages):
        retarget_module(pipe.get_stage_module(stage))


def trace(model: nn.Module, inputs: torch.Tensor, kwargs: dict[str, Any], chosen: TracedSplit,
          loss: str, spec: str) -> Any:
    """The model traced on one micro-batch and cut at ``chosen.starts`` (torch's ``Pipe``); one ConfigError
    line if the tracer cannot capture the forward or the cuts do not make the stages asked for."""
    def before(module: nn.Module, args: tuple, given: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        given = dict(given)
        if _takes(model, "use_cache"):
            given["use_cache"] = False
        if "labels" in given:  # used first on stage 0, so that it travels as an activation to the last
            given["labels"] = given["labels"].clone()
        return args, given

    def after(module: nn.Module, args: tuple, given: dict[str, Any], output: Any) -> Any:
        logits = outputs_of(output)
        return (model_loss_of(output), logits) if loss == "model" else logits

    hooks = [model.register_forward_pre_hook(before, with_kwargs=True),
             model.register_forward_hook(after, with_kwargs=True)]
    try:
        annotate_split_points(model, {name: SplitPoint.BEGINNING for name in chosen.starts})
        pipe = pipeline(model, mb_args=(inputs,), mb_kwargs=kwargs, split_policy=regions_as_calls)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - export's reasons are many; the first line says which
        first = next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"--model {spec} cannot be traced for a pipeline split ({type(exc).__name__}: "
                          f"{first[:160]}); make its forward traceable by torch.export (no data-dependent "
                          "Python control flow) or give --strategy pipeline an nn.Sequential of blocks") from None
    finally:
        for hook in hooks:
            hook.remove()
    if pipe.num_stages != len(chosen.starts) + 1:
        raise ConfigError(f"--split-at {','.join(chosen.starts)}: the traced forward gives {pipe.num_stages} "
                          f"stages, not {len(chosen.starts) + 1} (a split point that the forward calls more than "
                          "once, or not at all); split at modules the forward calls once, in order")
    return pipe


class Region:
    """A grad-mode or autocast region of a traced forward (``torch.no_grad()``, ``torch.autocast(...,
    enabled=False)``: a Hugging Face rotary embedding's) as a plain function of its inputs: its subgraph run
    under the same context. torch.export captures such a region as a higher-order op on a subgraph module,
    which the pipeline's outliner cannot carry into a stage (the stage module is left with an input that no
    one passes: "Expected positional argument for parameter ..."); a call of this holds the subgraph itself."""

    def __init__(self, graph_module: torch.fx.GraphModule, context: Callable[[], Any], what: str):
        self.graph_module, self.context, self.__name__ = graph_module, context, what

    def __call__(self, *args: Any) -> Any:
        with self.context():
            return self.graph_module(*args)


def regions_as_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The traced module with each grad-mode or autocast region made a :class:`Region` call (the pipeline's
    ``split_policy``: it runs on the traced module before the split; the split points are already marked)."""
    hop = torch.ops.higher_order
    grad, autocast = getattr(hop, "wrap_with_set_grad_enabled", None), getattr(hop, "wrap_with_autocast", None)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (grad, autocast) or node.target is None:
            continue
        if node.target is grad:
            enabled, sub, *operands = node.args
            context: Callable[[], Any] = lambda enabled=enabled: torch.set_grad_enabled(enabled)
        else:
            device_type, dtype, enabled, cache, sub, *operands = node.args
            context = lambda d=device_type, t=dtype, e=enabled, c=cache: torch.autocast(d, t, e, c)
        node.target = Region(getattr(gm, sub.target), context, f"region_{sub.target}")
        node.args = tuple(operands)
        if not sub.users:
            gm.graph.erase_node(sub)
    gm.recompile()
    return gm


def described(pipe: Any, chosen: TracedSplit, model: nn.Module) -> TracedSplit:
    """``chosen`` with each stage's layers (or top-level modules) and parameters filled in."""
    _, items = layers(model)
    names, params = [], []
    for stage in range(pipe.num_stages):
        module = pipe.get_stage_module(stage)
        held: list[str] = []
        for name, _ in module.named_parameters():
            unit = next((i for i in items if name.startswith(i + ".")), name.rpartition(".")[0] or name)
            if unit not in held:
                held.append(unit)
        names.append(tuple(held))
        own = {id(model.get_parameter(n)): p.numel() for n, p in module.named_parameters(remove_duplicate=False)}
        params.append(sum(own.values()))  # a tied tensor once, whichever names it holds it under
    return TracedSplit(chosen.starts, chosen.how, tuple(names), tuple(params), chosen.stage_ms)


def adopt(module: nn.Module, model: nn.Module) -> None:
    """Make ``module``'s (a traced stage's) parameters and buffers the model's own objects, by name: the
    tracer's copy of a tied tensor becomes the tied tensor itself."""
    own_params = dict(model.named_parameters(remove_duplicate=False))
    own_buffers = dict(model.named_buffers(remove_duplicate=False))
    for name, _ in list(module.named_parameters(remove_duplicate=False)):
        if name in own_params:
            parent, _, leaf = name.rpartition(".")
            module.get_submodule(parent)._parameters[leaf] = own_params[name]
    for name, _ in list(module.named_buffers(remove_duplicate=False)):
        if name in own_buffers:
            parent, _, leaf = name.rpartition(".")
            module.get_submodule(parent)._buffers[leaf] = own_buffers[name]


def stage_inputs(pipe_info: Any, stage: int) -> list[Any]:
    """The arguments of stage ``stage``'s node in the pipe's graph."""
    nodes = [n for n in pipe_info.graph.nodes if n.op == "call_module"]
    return list(nodes[stage].args)


def root_args(pipe_info: Any, inputs: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """What stage 0 is called with, in its graph's order of arguments: the inputs, and the labels where the
    forward takes them (the tracer names the graph's inputs after the forward's arguments)."""
    placeholders = [n.name for n in pipe_info.graph.nodes if n.op == "placeholder"]
    values = {placeholders[0]: inputs}
    if labels is not None:
        values["labels"] = labels
    return tuple(values[a.name] for a in stage_inputs(pipe_info, 0))


def dag_forward(pipe_info: Any, modules: dict[int, nn.Module], owner: Callable[[int], int], me: int,
                root: tuple[torch.Tensor, ...], group: Any, device: torch.device) -> Any:
    """The whole batch through every stage of the traced graph, each on its rank, each activation sent from
    the rank that makes it to each rank that uses it (what evaluation needs; no schedule). Every rank walks
    the stages in order, so sends and receives pair up. The last stage's output on its rank, None elsewhere."""
    nodes = [n for n in pipe_info.graph.nodes if n.op == "call_module"]
    index = {n.name: i for i, n in enumerate(nodes)}
    outputs: dict[int, Any] = {}
    for stage, node in enumerate(nodes):
        rank = owner(stage)
        args = []
        for position, arg in enumerate(node.args):
            if stage == 0:
                args.append(root[position])
                continue
            key = None
            source = arg
            if source.op == "call_function" and source.args and getattr(source.args[0], "op", "") == "call_module":
                key, source = source.args[1], source.args[0]
            producer = index[source.name]
            value = None
            if owner(producer) == me:
                value = outputs[producer] if key is None else outputs[producer][key]
            if owner(producer) != rank:
                if me == owner(producer):
                    send_activation(value, rank, group)
                elif me == rank:
                    value = recv_activation(owner(producer), group, device)
            args.append(value)
        if rank == me:
            outputs[stage] = modules[stage](*args)
    last = len(nodes) - 1
    return outputs[last] if owner(last) == me else None
