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

Each part estimates its own bytes: what a rank holds counted from the meta model and the optimizer
(:mod:`.memory_count`), activations (:mod:`.memory_saved`), then axis by axis of its coordinates, pp
(:mod:`polytrain.parallel.pp.memory`), tp (the tp plan's local shapes), dp_shard (:mod:`.fsdp_memory`), and what
the strategy keeps besides (:mod:`polytrain.strategies.memory`; ``async``'s servers and workers:
:mod:`polytrain.strategies.ps.memory`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from polytrain.devices.discovery import format_bytes
from polytrain.distributed.layout import Layout
from polytrain.parallel.memory_count import Count, RankMemory, probe_optimizer, tensor_sizes
from polytrain.parallel.memory_saved import Forward, data_bytes, sample

__all__ = ["MemoryEstimate", "RankMemory", "estimate_memory", "probe_optimizer"]


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


# -- the estimate ---------------------------------------------------------------------------------------

def estimate_memory(config: Any, layout: Layout) -> MemoryEstimate:
    """Each rank's memory for ``config`` laid out as ``layout``; ``skipped`` (with why) where the data or the
    model cannot be built without training (a factory that cannot build on the meta device)."""
    from polytrain.data.registry import data_of
    from polytrain.devices.spec import QUIET, resolve_device
    from polytrain.errors import PolytrainError
    from polytrain.models.registry import meta_build, model_name
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
    name = model_name(config, data)
    try:
        model = meta_build(name, config.model.model_args, data)
    except Exception as exc:  # noqa: BLE001 - any factory's failure: the estimate is skipped, the plan goes on
        return MemoryEstimate(strategy, model=name, limit=limit,
                              skipped=f"--model {name} cannot be built on the meta device ({type(exc).__name__}: "
                                      f"{exc}); the run itself is not affected")
    try:
        precision = precision_of(config)
        traits = declared_class(config, layout).traits  # (no strategy module imported)
        model = cast_model(model, precision, traits.own_precision)
        forward = Forward(precision.autocast_dtype,
                           tuple(n for n, _ in chosen_units(model, config.units.activation_checkpointing)))
        notes = []
        try:
            device = resolve_device(config.device.device, local_rank=0, soft=config.device.soft_placement,
                                    log=QUIET)
        except PolytrainError:
            device = torch.device("cpu")
            notes.append(f"activations counted as on the CPU: --device {config.device.device} is not available here")
        tensors = tensor_sizes(model)
        dtypes = {p.element_size(): p.dtype for p in model.parameters()} or {4: torch.float32}
        optimizers = {size: probe_optimizer(lambda ps: build_optimizer(ps, config.optim, config.optim.lr), dtype)
                      for size, dtype in dtypes.items()}
        count = Count(config, layout, model, tensors, optimizers, sample(data), get_task(data.task), device,
                      data_bytes(data), name, traits, forward, notes)
        ranks, micro, rule, notes = _ranks(count)
    except PolytrainError as exc:  # what the run itself refuses (too few units for the stages, ...)
        return MemoryEstimate(strategy, model=name, limit=limit, skipped=str(exc))
    return MemoryEstimate(strategy, name, config.optim.optimizer, micro, tuple(ranks), rule, tuple(notes), limit)


def _limit(config: Any) -> int | None:
    from polytrain.devices.memory_limit import parse_size

    return parse_size(config.device.memory_limit) if config.device.memory_limit else None


def _ranks(count: Count) -> tuple[list[RankMemory], int, str, list[str]]:
    rule = (f"activations: saved for backward by 1 micro-batch of {count.micro_batch()} example(s)"
            + (" per micro-batch in flight" if count.layout.axis("pp") > 1 else ""))
    if count.forward.autocast is not None:
        rule += f", under autocast to {str(count.forward.autocast).removeprefix('torch.')}"
    if count.forward.checkpointed:
        count.notes.append(f"--activation-checkpointing: {len(count.forward.checkpointed)} unit(s) save nothing "
                           "for backward; not counted: the inputs each keeps and one unit's recomputation "
                           "in backward")
    servers = any(count.layout.role(rank) == "server" for rank in range(count.layout.processes))
    if servers:  # a parameter server's loop: async's own estimate
        from polytrain.strategies.ps.memory import ranks as async_ranks

        return async_ranks(count), count.micro_batch(), rule, count.notes
    ranks = _mesh(count)
    return ranks, count.micro_batch(), rule, count.notes


def _mesh(count: Count) -> list[RankMemory]:
    """Every trainer's share, axis by axis of its coordinates: its stages (pp), its part of the layers the
    tp plan splits (tp), its shard of each (dp_shard, as FSDP2 cuts them), and what the strategy keeps
    besides (diloco's anchor and outer momentum)."""
    from polytrain.parallel.fsdp_memory import gathered, gathered_units, sharded
    from polytrain.parallel.pp.memory import stages as stages_of
    from polytrain.strategies.memory import copies, notes

    layout = count.layout
    pp, tp, shard = layout.axis("pp"), layout.axis("tp"), layout.axis("dp_shard")
    stages = stages_of(count) if pp > 1 else None
    found = count.activations() if stages is None else None
    shapes = {}
    if tp > 1:
        from polytrain.parallel.tp.plan import plan_for

        shapes = plan_for(count.model, count.config.tp.tp_plan).local_shapes(count.model, tp)
        count.notes.append(f"tp: the split layers' weights, gradients and optimizer state 1/{tp} on each rank; "
                           "activations counted as the whole model's")
    units = gathered_units(count, shapes) if shard > 1 else []
    out = []
    for rank in range(layout.processes):
        if layout.role(rank) != "trainer":
            out.append(RankMemory(rank, layout.role(rank), "not estimated (a rank of its own loop)", 0, 0, 0,
                                  None))
            continue
        at = layout.coordinates(rank)
        tensors, held, holds = stages[at["pp"]] if stages is not None else \
            (count.tensors, found[0] if found else None, "the whole model")
        if shapes:
            tensors = [replace(t, shape=shapes.get(t.name, t.shape)) for t in tensors]
            holds += f", 1/{tp} of its split layers"
        if layout.axis("dp_replicate") > 1 and stages is not None:
            holds += f", replica {at['dp_replicate']}"
        if shard > 1:
            params, grads, state = sharded(count, tensors, shard, at["dp_shard"])
            extra, what = gathered(count, tensors, units, stages is not None)
            row = RankMemory(rank, layout.role(rank), f"1/{shard} of {holds}", params, grads, state, held, extra,
                             what, count.data)
        else:
            row = count.rank(rank, holds, tensors, held)
        out.append(copies(count, row, tensors, shard, at.get("dp_shard", 0)))
    notes(count)
    return out
