"""The memory plan's pp axis: each pipeline coordinate's stages (cut where ``--split-at`` says, by the tracer, or,
for ``auto``, evenly by parameters), the activations its schedule holds in flight at once, and how a rank comes
to hold only its stages (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

from typing import Any

from polytrain.devices.discovery import format_bytes
from polytrain.parallel.memory_count import Count, TensorSize, tensor_sizes


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


def stages(count: Count) -> list[tuple[list[TensorSize], int | None, str]]:
    """For each coordinate on the pp axis: the tensors of its stages, the activation bytes it holds at most
    (None: not estimated) and what it holds, in words."""
    from polytrain.parallel.pp import plan, split
    from polytrain.parallel.pp.traced_run import chain_kind, must_trace

    opts = count.config.pipeline
    info = plan.schedule_info(opts.schedule)
    pp = count.layout.axis("pp")
    if not chain_kind(count.model) or must_trace(count.model, split.parse_split(opts.split_at),
                                                count.config.train.loss):
        return traced_stages(count)  # cut by the tracer (parallel/pp/traced.py)
    stages = pp * info.chunks
    parts = split.units(count.model)
    names = [name for name, _ in parts]
    split.check_splittable(names, stages, f"--pp/--schedule ({stages} stages in all)")
    per_unit = [tensor_sizes(unit, f"{name}.") for name, unit in parts]
    starts = split.parse_split(opts.split_at)
    if starts is not None:
        cuts = split.cuts_from_names(names, starts, stages)
    else:
        cuts = split.balanced_cuts([float(count.params(ts)) for ts in per_unit], stages)
        count.notes.append("--split-at auto: the run cuts by measured time; estimated with stages of equal "
                           "parameters")
    groups = split.groups(cuts, len(names))
    stage_units = [[names[i] for i in g] for g in groups]
    per_stage = count.activations(stage_units)
    held = in_flight(opts.schedule, pp, opts.microbatches, per_stage) if per_stage else [None] * pp
    count.notes.append(build_note(count, per_unit))
    out = []
    for me in range(pp):
        mine = plan.rank_stages(me, pp, info.chunks, info.placement)
        tensors = [t for s in mine for i in groups[s] for t in per_unit[i]]
        out.append((tensors, held[me], ", ".join(f"stage {s} ({span(stage_units[s])})" for s in mine)))
    return out

def traced_stages(count: Count) -> list[tuple[list[TensorSize], int | None, str]]:
    """A model the tracer cuts: each coordinate its stages' tensors (a tensor tied across stages on each rank
    using it), activations not estimated."""
    from polytrain.parallel.pp.traced_run import plan_split

    chosen = plan_split(count.config, count.layout)
    names: dict[int, list[str]] = {}
    for name, param in count.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    aliases = {group[0]: group for group in names.values()}
    count.notes.append("pipeline (traced): each rank makes only its stages' tensors, with single's values "
                       "(a map of the model's build on the meta device first); activations not estimated")
    out = []
    for me in range(count.layout.axis("pp")):
        prefixes = tuple(f"{n}." for n in chosen.stage_names[me])
        tensors = [t for t in count.tensors if any(a.startswith(prefixes) for a in aliases.get(t.name, [t.name]))]
        out.append((tensors, None, f"stage {me} ({span(list(chosen.stage_names[me]))})"))
    return out

def build_note(count: Count, per_unit: list[list[Any]]) -> str:
    """How a pipeline rank comes to hold only its stages: made unit by unit, or the whole model first."""
    from polytrain.models.deferred import deferrable

    if deferrable(count.model):
        largest = max(count.params(ts) for ts in per_unit)
        return ("pipeline: each rank makes only its stages' units, one at a time (--split-at auto: rank 0 "
                f"first makes each unit only while timing it, {format_bytes(largest)} at most)")
    return (f"pipeline: before its first step every rank holds the whole model's parameters "
            f"({format_bytes(count.params(count.tensors))}) (it cannot be built on the meta device); the other "
            "stages' are then emptied")


def span(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
