"""Memory planned: each rank's bytes for parameters, gradients, optimizer state and activations, before a run.

``polytrain plan`` prints :func:`estimate_memory`'s :class:`MemoryEstimate` beside the layout (and in
``--json``), starting no process and allocating no model: the model is built on the meta device, as a
pipeline's check builds it. What each rank holds follows the strategy, as its code keeps it:

* every trainer of ``single``, ``sync``, ``local-sgd``, ``diloco`` (and of a strategy of your own) holds the
  whole model, its gradients and its optimizer state (``diloco`` also its anchor, a copy of the parameters,
  and the outer momentum);
* ``async``: a worker holds the whole model and its gradients, and buffers of the parameters' size for the
  values it pulls; its optimizer is never stepped. A parameter server holds its share of the parameters (the
  partition ``async`` cuts), of the gradients and of the optimizer state, besides the model it was built with;
* ``pipeline`` and ``hybrid``: a rank holds its stages' parameters, gradients and optimizer state, cut where
  ``--split-at`` says, or, for ``auto`` (which the run decides by measured time), evenly by parameters;
* ``fsdp``: a rank holds 1/N of every parameter and gradient (dim-0 shards, padded to equal size as FSDP2
  pads them) and the optimizer state of its unpadded shard, plus, during forward and backward, the largest
  unit's whole parameters (with ``--no-reshard-after-forward``: every unit's, between forward and backward).

Optimizer state comes from the optimizer itself: ``--optimizer`` is built over a throwaway parameter and
stepped once, and every state tensor of the parameter's shape counts as bytes per element (SGD with momentum:
one buffer; Adam: two), every other one as bytes per parameter tensor (Adam's 4-byte ``step``).

Activations: the bytes autograd saves for backward, counted by the same :class:`~polytrain.train.memory.SavedTensors`
the run measures them with, on one forward (and the task's loss) of a micro-batch over fake tensors of the
run's device type (``FakeTensorMode``: shapes and dtypes, no memory; the meta device's kernels would save
what another device's do not, e.g. attention's weights). A pipeline rank holds as many micro-batches' as its
schedule has in flight at once (a forward adds one, its backward frees it; a zero-bubble schedule's weight
pass frees it). As the run does, ``--precision bf16-true`` casts the model and the mixed modes run the forward
under autocast; a unit under ``--activation-checkpointing`` saves nothing autograd counts (what it keeps, its
inputs, and recomputes in backward are left out, as the run's measurement leaves them out).
"""

from __future__ import annotations

import contextlib
import copy
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torch import nn

from polytrain.devices.discovery import format_bytes
from polytrain.distributed.layout import Layout
from polytrain.train.memory import SavedTensors



@dataclass(frozen=True)
class RankMemory:
    """One rank's estimate, in bytes. ``extra``: held besides its state and activations (``extra_what`` says
    what); ``data``: the dataset's tensors, which every rank loads."""

    rank: int
    role: str
    holds: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int | None
    extra: int = 0
    extra_what: str = ""
    data: int | None = None

    @property
    def state(self) -> int:
        """Parameters (with buffers), gradients and optimizer state: what a run's ``rank_memory_bytes`` counts."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def total(self) -> int:
        return self.state + (self.activations or 0) + self.extra + (self.data or 0)


@dataclass(frozen=True)
class MemoryEstimate:
    """Every rank's estimate (plain data: printable, comparable, JSON through :meth:`as_dict`); ``skipped``
    says why there is none."""

    strategy: str
    model: str = ""
    optimizer: str = ""
    micro_batch: int = 0
    ranks: tuple[RankMemory, ...] = ()
    activation_rule: str = ""
    notes: tuple[str, ...] = ()
    limit: int | None = None
    skipped: str = ""

    def describe(self) -> str:
        if self.skipped:
            return f"memory estimate: skipped: {self.skipped}"
        lines = [f"memory estimate per rank ({self.model}, --optimizer {self.optimizer}; {self.activation_rule}):"]
        header = ("rank", "holds", "parameters", "gradients", "optimizer", "activations", "other", "data", "total")
        rows = [[str(r.rank), r.holds, format_bytes(r.parameters), format_bytes(r.gradients),
                 format_bytes(r.optimizer), format_bytes(r.activations), format_bytes(r.extra) if r.extra else "-",
                 format_bytes(r.data), format_bytes(r.total)] for r in self.ranks]
        widths = [max(len(row[i]) for row in [list(header), *rows]) for i in range(len(header))]
        for row in [list(header), *rows]:
            lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        others = sorted({r.extra_what for r in self.ranks if r.extra})
        notes = [*(f"other: {what}" for what in others), *self.notes]
        if self.limit is not None:
            over = [r.rank for r in self.ranks if r.total > self.limit]
            notes.append(f"--memory-limit {format_bytes(self.limit)} per worker: "
                         + (f"rank(s) {', '.join(map(str, over))} estimated over it" if over else "every rank fits"))
        lines += [f"  {note}" for note in notes]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = [{**asdict(r), "state": r.state, "total": r.total} for r in self.ranks]
        return out


# -- the optimizer's state, from the optimizer ----------------------------------------------------------

@dataclass(frozen=True)
class OptimizerState:
    """Bytes an optimizer keeps per parameter tensor: ``per_element`` x its elements + ``per_tensor``, once
    built (``built_*``) and once stepped."""

    per_element: int
    per_tensor: int
    built_per_element: int
    built_per_tensor: int
    tensors: tuple[str, ...]

    def bytes(self, numel: int, stepped: bool = True) -> int:
        if stepped:
            return self.per_element * numel + self.per_tensor
        return self.built_per_element * numel + self.built_per_tensor


def probe_optimizer(make_optimizer: Any, dtype: torch.dtype = torch.float32) -> OptimizerState:
    """What ``make_optimizer([param])`` keeps for a parameter of ``dtype``, built and after one step."""
    param = nn.Parameter(torch.zeros(2, 3, dtype=dtype))
    param.grad = torch.zeros_like(param)
    optimizer = make_optimizer([param])

    def sizes() -> tuple[int, int, list[str]]:
        per_element = per_tensor = 0
        names = []
        for key, value in sorted(optimizer.state.get(param, {}).items()):
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == param.shape:
                per_element += value.element_size()
                names.append(key)
            else:
                per_tensor += value.untyped_storage().nbytes()
        return per_element, per_tensor, names

    built_element, built_tensor, _ = sizes()
    optimizer.step()
    per_element, per_tensor, names = sizes()
    return OptimizerState(per_element, per_tensor, built_element, built_tensor, tuple(names))


# -- the model, without memory --------------------------------------------------------------------------

@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    element_size: int
    trained: bool  # a parameter that gets a gradient and optimizer state (not a buffer, not frozen)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> int:
        return self.numel * self.element_size


def _tensors(module: nn.Module, prefix: str = "") -> list[_Tensor]:
    params = [_Tensor(prefix + n, tuple(p.shape), p.element_size(), p.requires_grad)
              for n, p in module.named_parameters()]
    buffers = [_Tensor(prefix + n, tuple(b.shape), b.element_size(), False) for n, b in module.named_buffers()]
    return params + buffers


@dataclass
class _Inputs:
    """One micro-batch's shapes and dtypes (from the data's first examples)."""

    inputs: tuple[tuple[int, ...], torch.dtype]
    targets: tuple[tuple[int, ...], torch.dtype]

    def make(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        (x, xd), (y, yd) = self.inputs, self.targets
        return (torch.zeros((batch, *x), dtype=xd, device=device), torch.zeros((batch, *y), dtype=yd, device=device))


def _sample(data: Any) -> _Inputs:
    dataset = data.train
    count = 1 if data.streamed else min(2, len(dataset))
    if data.streamed:  # (rows of seq_len tokens: nothing is read for their shape)
        x, y = (t.unsqueeze(0) for t in data.shape_example())
    elif hasattr(dataset, "get_batch"):
        x, y = dataset.get_batch(torch.arange(count), 0)
    else:
        x, y = torch.utils.data.default_collate([dataset[i] for i in range(count)])
    x_shape, y_shape = tuple(x.shape[1:]), tuple(y.shape[1:])
    if data.task == "lm" and data.seq_len and x_shape:  # the longest sequence: the most a step can hold
        x_shape, y_shape = (data.seq_len, *x_shape[1:]), (data.seq_len, *y_shape[1:]) if y_shape else y_shape
    return _Inputs((x_shape, x.dtype), (y_shape, y.dtype))


def _data_bytes(data: Any) -> int | None:
    """The bytes of the dataset's in-memory tensors (train and test), when it keeps them as tensors."""
    total = 0
    for part in (data.train, data.test):
        if part is None:
            continue
        tensors = [v for v in vars(part).values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return None
        total += sum(t.untyped_storage().nbytes() for t in tensors)
    return total


class _Fake:
    """The meta model's copy on fake tensors of ``device`` (shapes and dtypes, no memory), for forwards."""

    def __init__(self, model: nn.Module, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.model = copy.deepcopy(model)
        convert = self.mode.fake_tensor_converter.from_meta_and_device
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    fake = convert(self.mode, param.detach(), device)
                    module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = convert(self.mode, buffer, device)


@dataclass(frozen=True)
class _Forward:
    """How a run's forward goes: under autocast to ``autocast`` (None: none), with the units named in
    ``checkpointed`` under activation checkpointing."""

    autocast: torch.dtype | None = None
    checkpointed: tuple[str, ...] = ()


def _saved(model: nn.Module, stages: list[list[str]] | None, inputs: _Inputs, batch: int, task: Any,
           device: torch.device, forward: _Forward = _Forward()) -> list[int]:
    """The bytes saved for backward by one micro-batch of ``batch`` examples on ``device`` (fake tensors; the
    meta device as it is): the whole model's forward and loss (``stages`` None), or each stage's (its units
    in order, the last with the loss), each stage's input a tensor of its own, as a pipeline stage receives it."""
    from polytrain.train.unit_options import checkpoint_unit

    if device.type == "meta":
        mode, whole = contextlib.nullcontext(), copy.deepcopy(model)
    else:
        fake = _Fake(model, device)
        mode, whole = fake.mode, fake.model
    units = dict(whole.named_modules())
    for name in forward.checkpointed:
        checkpoint_unit(units[name])
    cast = (torch.autocast(device.type, forward.autocast) if forward.autocast is not None and device.type != "meta"
            else contextlib.nullcontext())
    found = []
    with mode, cast:
        x, y = inputs.make(batch, device)
        for index, stage in enumerate(stages or [[""]]):  # "": the whole model
            counter = SavedTensors(shapes=True)  # (its forward runs on fake or meta tensors)
            if index:
                x = x.detach().clone().requires_grad_(x.is_floating_point())
            with counter.hooks():
                for unit in stage:
                    x = units[unit](x)
                if index == len(stages or [[""]]) - 1:
                    task.loss(x, y)
            found.append(counter.peak)
    return found


def _activations(model: nn.Module, stages: list[list[str]] | None, inputs: _Inputs, batch: int,
                 task: Any, device: torch.device, forward: _Forward = _Forward()) -> tuple[list[int] | None, str]:
    """:func:`_saved` on fake tensors of ``device``, or, if that forward fails, on the meta device (with
    why); None if both fail (and why)."""
    tried: list[str] = []
    for where in dict.fromkeys([device, torch.device("meta")]):
        try:
            found = _saved(model, stages, inputs, batch, task, where, forward)
        except Exception as exc:  # noqa: BLE001 - a forward that needs real values: say so, estimate the rest
            first = str(exc).splitlines()[0] if str(exc) else ""
            tried.append(f"a forward on {where.type} {'fake ' if where.type != 'meta' else ''}tensors failed "
                         f"({type(exc).__name__}: {first})")
            continue
        return found, (f"counted on the meta device, whose kernels may save other tensors: {'; '.join(tried)}"
                       if tried else "")
    return None, "not estimated: " + "; ".join(tried)


def in_flight(schedule: str, ranks: int, microbatches: int, stage_bytes: list[int]) -> list[int]:
    """Each rank's most activation bytes held at once over one step of ``schedule``: a forward of a stage
    holds that stage's bytes until its backward (``B``), or, backward split, until its weight pass (``W``)."""
    from polytrain.parallel.pp import plan

    peaks = []
    for actions in plan.actions(schedule, ranks, microbatches):
        held = peak = 0
        for action in actions:
            if action.kind == "F":
                held += stage_bytes[action.stage]
                peak = max(peak, held)
            elif action.kind in ("B", "W"):  # (an input pass, I, keeps what its weight pass needs)
                held -= stage_bytes[action.stage]
        peaks.append(peak)
    return peaks


# -- the estimate ---------------------------------------------------------------------------------------

def estimate_memory(config: Any, layout: Layout) -> MemoryEstimate:
    """Each rank's memory for ``config`` laid out as ``layout``; ``skipped`` (with why) where the data or the
    model cannot be built without training (a factory that cannot build on the meta device)."""
    from polytrain.data.registry import data_of
    from polytrain.devices.spec import QUIET, resolve_device
    from polytrain.errors import PolytrainError
    from polytrain.models.registry import build_model
    from polytrain.precision import cast_model, precision_of
    from polytrain.strategies.registry import declared_class
    from polytrain.tasks import get_task
    from polytrain.train.optim import build_optimizer
    from polytrain.train.unit_options import chosen_units

    strategy = layout.strategy
    limit = _limit(config)
    try:
        data = data_of(config)
    except PolytrainError as exc:
        return MemoryEstimate(strategy, limit=limit, skipped=f"the data could not be read: {exc}")
    name = data.default_model if config.model.model == "auto" else config.model.model
    try:
        with torch.device("meta"):
            model = build_model(name, config.model.model_args, input_shape=data.input_shape,
                                num_classes=data.num_outputs)
    except Exception as exc:  # noqa: BLE001 - any factory's failure: the estimate is skipped, the plan goes on
        return MemoryEstimate(strategy, model=name, limit=limit,
                              skipped=f"--model {name} cannot be built on the meta device ({type(exc).__name__}: "
                                      f"{exc}); the run itself is not affected")
    try:
        precision = precision_of(config)
        traits = declared_class(config, layout).traits  # (no strategy module imported)
        model = cast_model(model, precision, traits.own_precision)
        forward = _Forward(precision.autocast_dtype,
                           tuple(n for n, _ in chosen_units(model, config.units.activation_checkpointing)))
        notes = []
        try:
            device = resolve_device(config.device.device, local_rank=0, soft=config.device.soft_placement,
                                    log=QUIET)
        except PolytrainError:
            device = torch.device("cpu")
            notes.append(f"activations counted as on the CPU: --device {config.device.device} is not available here")
        tensors = _tensors(model)
        dtypes = {p.element_size(): p.dtype for p in model.parameters()} or {4: torch.float32}
        optimizers = {size: probe_optimizer(lambda ps: build_optimizer(ps, config.optim, config.optim.lr), dtype)
                      for size, dtype in dtypes.items()}
        context = _Context(config, layout, model, tensors, optimizers, _sample(data), get_task(data.task), device,
                           _data_bytes(data), name, traits, forward, notes)
        ranks, micro, rule, notes = context.ranks()
    except PolytrainError as exc:  # what the run itself refuses (too few units for the stages, ...)
        return MemoryEstimate(strategy, model=name, limit=limit, skipped=str(exc))
    return MemoryEstimate(strategy, name, config.optim.optimizer, micro, tuple(ranks), rule, tuple(notes), limit)


def _limit(config: Any) -> int | None:
    from polytrain.devices.memory_limit import parse_size

    return parse_size(config.device.memory_limit) if config.device.memory_limit else None


@dataclass
class _Context:
    config: Any
    layout: Layout
    model: nn.Module
    tensors: list[_Tensor]
    optimizers: dict[int, OptimizerState]
    inputs: _Inputs
    task: Any
    device: torch.device
    data: int | None
    name: str
    traits: Any  # the running strategy's (polytrain.strategies.traits.Traits): the copies it keeps, ...
    forward: _Forward = _Forward()
    notes: list[str] = field(default_factory=list)

    @property
    def _param_names(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()}

    # -- sums over tensors ---------------------------------------------------------------------------

    def params(self, tensors: list[_Tensor]) -> int:
        return sum(t.bytes for t in tensors)

    def grads(self, tensors: list[_Tensor]) -> int:
        return sum(t.bytes for t in tensors if t.trained)

    def state(self, tensors: list[_Tensor], stepped: bool = True) -> int:
        return sum(self.optimizers[t.element_size].bytes(t.numel, stepped) for t in tensors if t.trained)

    def rank(self, rank: int, holds: str, tensors: list[_Tensor], activations: int | None, **more: Any) -> RankMemory:
        return RankMemory(rank, self.layout.role(rank), holds, self.params(tensors), self.grads(tensors),
                          self.state(tensors), activations, data=self.data, **more)

    # -- per strategy --------------------------------------------------------------------------------

    def micro_batch(self) -> int:
        cfg, layout = self.config, self.layout
        if layout.axis("pp") > 1:
            return cfg.global_batch(layout.slices) // layout.axis("dp") // cfg.pipeline.microbatches
        return max(1, cfg.global_batch(layout.slices) // layout.slices // cfg.train.accumulate)

    def activations(self, stages: list[list[str]] | None = None) -> list[int] | None:
        found, why = _activations(self.model, stages, self.inputs, self.micro_batch(), self.task, self.device,
                                  self.forward)
        if why:
            self.notes.append(f"activations {why}")
        return found

    def ranks(self) -> tuple[list[RankMemory], int, str, list[str]]:
        rule = (f"activations: saved for backward by 1 micro-batch of {self.micro_batch()} example(s)"
                + (" per micro-batch in flight" if self.layout.axis("pp") > 1 else ""))
        if self.forward.autocast is not None:
            rule += f", under autocast to {str(self.forward.autocast).removeprefix('torch.')}"
        if self.forward.checkpointed:
            self.notes.append(f"--activation-checkpointing: {len(self.forward.checkpointed)} unit(s) save nothing "
                              "for backward; not counted: the inputs each keeps and one unit's recomputation "
                              "in backward")
        servers = any(self.layout.role(rank) == "server" for rank in range(self.layout.processes))
        ranks = self._async() if servers else self._mesh()
        return ranks, self.micro_batch(), rule, self.notes

    # -- axis by axis ---------------------------------------------------------------------------------

    def _mesh(self) -> list[RankMemory]:
        """Every trainer's share, axis by axis of its coordinates: its stages (pp), its part of the layers the
        tp plan splits (tp), its shard of each (dp_shard, as FSDP2 cuts them), and what the strategy keeps
        besides (diloco's anchor and outer momentum)."""
        layout = self.layout
        pp, tp, shard = layout.axis("pp"), layout.axis("tp"), layout.axis("dp_shard")
        stages = self._stages() if pp > 1 else None
        found = self.activations() if stages is None else None
        shapes = {}
        if tp > 1:
            from polytrain.parallel.tp.plan import plan_for

            shapes = plan_for(self.model, self.config.tp.tp_plan).local_shapes(self.model, tp)
            self.notes.append(f"tp: the split layers' weights, gradients and optimizer state 1/{tp} on each rank; "
                              "activations counted as the whole model's")
        units = self._gathered_units(shapes) if shard > 1 else []
        out = []
        for rank in range(layout.processes):
            if layout.role(rank) != "trainer":
                out.append(RankMemory(rank, layout.role(rank), "not estimated (a rank of its own loop)", 0, 0, 0,
                                      None))
                continue
            at = layout.coordinates(rank)
            tensors, held, holds = stages[at["pp"]] if stages is not None else \
                (self.tensors, found[0] if found else None, "the whole model")
            if shapes:
                tensors = [replace(t, shape=shapes.get(t.name, t.shape)) for t in tensors]
                holds += f", 1/{tp} of its split layers"
            if layout.axis("dp_replicate") > 1 and stages is not None:
                holds += f", replica {at['dp_replicate']}"
            if shard > 1:
                params, grads, state = self.sharded(tensors, shard, at["dp_shard"])
                extra, what = self._gathered(tensors, units, stages is not None)
                row = RankMemory(rank, layout.role(rank), f"1/{shard} of {holds}", params, grads, state, held, extra,
                                 what, self.data)
            else:
                row = self.rank(rank, holds, tensors, held)
            out.append(self._strategy_copies(row, tensors, shard, at.get("dp_shard", 0)))
        self._strategy_notes()
        return out

    def _strategy_copies(self, row: RankMemory, tensors: list[_Tensor], shard: int, index: int) -> RankMemory:
        """``row`` with the copies of the parameters the strategy keeps (``traits.copies``): an anchor (diloco's:
        every parameter) and its outer momentum (the trained ones), of this rank's shard."""
        if "anchor" not in self.traits.copies:
            return row
        params = [t for t in tensors if t.name in self._param_names]
        outer = self.config.periodic.outer_momentum
        if shard > 1:
            anchor, momentum, _ = self.sharded(params, shard, index)
        else:
            anchor, momentum = self.params(params), self.grads(params)
        return replace(row, optimizer=row.optimizer + anchor + (momentum if (0.9 if outer is None else outer) > 0
                                                                 else 0))

    def _strategy_notes(self) -> None:
        strategy = self.layout.strategy
        if "anchor" in self.traits.copies:
            self.notes.append(f"{strategy}'s optimizer column includes its anchor (a copy of the parameters) and "
                              "the outer momentum")
        elif not self.traits.exchange and self.layout.processes > 1:  # a strategy of one's own
            self.notes.append(f"--strategy {strategy} is estimated as a data-parallel one: each trainer holds the "
                              "whole model")

    def _gathered_units(self, shapes: dict[str, tuple[int, ...]]) -> list[int]:
        """Each unit's parameter bytes (its tp part where tp splits it): what FSDP gathers whole for it."""
        from polytrain.parallel.pp.split import units

        out = []
        for name, unit in units(self.model):
            tensors = [replace(t, shape=shapes.get(t.name, t.shape)) for t in _tensors(unit, f"{name}.")]
            out.append(self.params(tensors))
        return out or [self.params(self.tensors)]

    def _gathered(self, tensors: list[_Tensor], units: list[int], staged: bool) -> tuple[int, str]:
        """What a sharded rank holds gathered besides its shards, and what that is."""
        if staged:  # a pipeline's stages stay gathered from a step's first forward to its last backward
            return self.params(tensors), "--dp-shard in a pipeline: the stages' whole parameters, gathered for " \
                                         "the step"
        reshard = getattr(getattr(self.config, "fsdp", None), "reshard_after_forward", True)
        if reshard:
            return max(units), "fsdp: the largest unit's whole parameters, gathered for its forward and backward"
        return sum(units), ("fsdp --no-reshard-after-forward: every unit's whole parameters, gathered from forward "
                            "to backward")

    def sharded(self, tensors: list[_Tensor], n: int, index: int) -> tuple[int, int, int]:
        """(parameter, gradient, optimizer) bytes of shard ``index`` of ``n`` of ``tensors``, as FSDP2 cuts them:
        dim-0 chunks padded to equal size, the optimizer's state over the unpadded rows."""
        params = grads = state = 0
        for t in tensors:
            rows = t.shape[0] if t.shape else 1
            row = t.numel // max(rows, 1) * t.element_size if t.shape else t.element_size
            chunk = -(-rows // n)
            mine = max(0, min(chunk, rows - index * chunk))
            params += chunk * row
            if t.trained:
                grads += chunk * row
                state += self.optimizers[t.element_size].bytes(mine * row // t.element_size)
        return params, grads, state

    def _async(self) -> list[RankMemory]:
        from polytrain.strategies.ps.partition import PartitionPlan

        found = self.activations()
        act = found[0] if found else None
        servers = [rank for rank in range(self.layout.processes) if self.layout.role(rank) == "server"]
        params = [t for t in self.tensors if t.name in self._param_names]
        partition = PartitionPlan.build(((t.name, t.shape) for t in params), max(1, len(servers)))
        size = params[0].element_size if params else 4
        opt = self.optimizers[size]
        out = []
        for rank in range(self.layout.processes):
            if rank in servers:
                index = servers.index(rank)
                pieces, numel = partition.pieces_of(index), partition.numel(index)
                share = f"server {index}: {numel / max(1, partition.total):.0%} of the parameters"
                out.append(RankMemory(rank, "server", share, self.params(self.tensors) + numel * size, numel * size,
                                      sum(opt.bytes(p.numel) for p in pieces), None, data=self.data))
                continue
            r = self.rank(rank, "the whole model", self.tensors, act, extra=self.params(params),
                          extra_what="async: a worker's buffers for the values it pulls")
            out.append(replace(r, optimizer=self.state(self.tensors, stepped=False)))
        self.notes.append("async: a server's parameters include the whole model it was built with (besides its "
                          "share); a worker's optimizer is never stepped")
        return out

    # -- pp: each pipeline coordinate's stages ----------------------------------------------------------

    def _stages(self) -> list[tuple[list[_Tensor], int | None, str]]:
        """For each coordinate on the pp axis: the tensors of its stages, the activation bytes it holds at most
        (None: not estimated) and what it holds, in words."""
        from polytrain.parallel.pp import plan, split
        from polytrain.parallel.pp.traced_run import chain_kind, must_trace

        opts = self.config.pipeline
        info = plan.schedule_info(opts.schedule)
        pp = self.layout.axis("pp")
        if not chain_kind(self.model) or must_trace(self.model, split.parse_split(opts.split_at),
                                                    self.config.train.loss):
            return self._traced_stages()  # cut by the tracer (parallel/pp/traced.py)
        stages = pp * info.chunks
        parts = split.units(self.model)
        names = [name for name, _ in parts]
        split.check_splittable(names, stages, f"--pp/--schedule ({stages} stages in all)")
        per_unit = [_tensors(unit, f"{name}.") for name, unit in parts]
        starts = split.parse_split(opts.split_at)
        if starts is not None:
            cuts = split.cuts_from_names(names, starts, stages)
        else:
            cuts = split.balanced_cuts([float(self.params(ts)) for ts in per_unit], stages)
            self.notes.append("--split-at auto: the run cuts by measured time; estimated with stages of equal "
                              "parameters")
        groups = split.groups(cuts, len(names))
        stage_units = [[names[i] for i in g] for g in groups]
        per_stage = self.activations(stage_units)
        held = in_flight(opts.schedule, pp, opts.microbatches, per_stage) if per_stage else [None] * pp
        self.notes.append(self._pipeline_build_note(per_unit))
        out = []
        for me in range(pp):
            mine = plan.rank_stages(me, pp, info.chunks, info.placement)
            tensors = [t for s in mine for i in groups[s] for t in per_unit[i]]
            out.append((tensors, held[me], ", ".join(f"stage {s} ({_span(stage_units[s])})" for s in mine)))
        return out

    def _traced_stages(self) -> list[tuple[list[_Tensor], int | None, str]]:
        """A model the tracer cuts: each coordinate its stages' tensors (a tensor tied across stages on each rank
        using it), activations not estimated."""
        from polytrain.parallel.pp.traced_run import plan_split

        chosen = plan_split(self.config, self.layout)
        names: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            names.setdefault(id(param), []).append(name)
        aliases = {group[0]: group for group in names.values()}
        self.notes.append("pipeline (traced): each rank makes only its stages' tensors, with single's values "
                          "(a map of the model's build on the meta device first); activations not estimated")
        out = []
        for me in range(self.layout.axis("pp")):
            prefixes = tuple(f"{n}." for n in chosen.stage_names[me])
            tensors = [t for t in self.tensors if any(a.startswith(prefixes) for a in aliases.get(t.name, [t.name]))]
            out.append((tensors, None, f"stage {me} ({_span(list(chosen.stage_names[me]))})"))
        return out

    def _pipeline_build_note(self, per_unit: list[list[Any]]) -> str:
        """How a pipeline rank comes to hold only its stages: made unit by unit, or the whole model first."""
        from polytrain.models.deferred import deferrable

        if deferrable(self.model):
            largest = max(self.params(ts) for ts in per_unit)
            return ("pipeline: each rank makes only its stages' units, one at a time (--split-at auto: rank 0 "
                    f"first makes each unit only while timing it, {format_bytes(largest)} at most)")
        return (f"pipeline: before its first step every rank holds the whole model's parameters "
                f"({format_bytes(self.params(self.tensors))}) (it cannot be built on the meta device); the other "
                "stages' are then emptied")


def _span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"

