"""Pipeline schedules as data: which stage does what, in which order, and how much of the time is bubble.

A schedule is, per rank, an ordered list of :class:`Action` (``F`` forward, ``B`` full backward, ``I``
backward to the input only, ``W`` backward to the weights only) of one micro-batch on one stage. Stages are
*virtual*: with ``v`` chunks per rank there are ``v * P`` stages, placed round-robin (``loop``: stage s on
rank s mod P) or folded (``v``: rank r holds stages r and 2P-1-r).

``gpipe``, ``1f1b`` and ``interleaved-1f1b`` are generated here, in the order the runtime executes them
(``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` loops, and the action lists that
``ScheduleInterleaved1F1B`` runs; a test checks the last against torch). The zero-bubble schedules are read
from torch's own ``pipeline_order``, which is exactly what its runtime executes, built with stand-in stage
records: no process, no group.

:func:`simulate` replays the lists with unit costs (F = I = W = 1, B = 2) and each action waiting for its
producer on the neighbouring stage, giving a time x rank chart and the simulated bubble beside the
theoretical ``(P-1)/(v*M+P-1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from types import SimpleNamespace
from typing import NamedTuple

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    torch_class: str  # in torch.distributed.pipelining.schedules
    chunks: int  # stages per rank (v)
    placement: str  # "loop" or "v"
    about: str


SCHEDULES: dict[str, ScheduleInfo] = {s.name: s for s in (
    ScheduleInfo("gpipe", "ScheduleGPipe", 1, "loop", "all forwards, then all backwards (fill-drain)"),
    ScheduleInfo("1f1b", "Schedule1F1B", 1, "loop", "one forward, one backward in the steady state: "
                                                    "at most P micro-batches' activations held"),
    ScheduleInfo("interleaved-1f1b", "ScheduleInterleaved1F1B", 2, "loop",
                 "1F1B over 2 model chunks per rank (stages r and r+P): a smaller bubble, twice the messages"),
    ScheduleInfo("zero-bubble", "ScheduleInterleavedZeroBubble", 2, "loop",
                 "interleaved, backward split into input (I) and weight (W) parts that fill the bubble"),
    ScheduleInfo("zbv", "ScheduleZBVZeroBubble", 2, "v", "zero bubble with chunks folded in a V "
                                                         "(rank r holds stages r and 2P-1-r)"),
)}

COSTS = {"F": 1, "B": 2, "I": 1, "W": 1}


class Action(NamedTuple):
    kind: str  # F, B, I or W
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"s{self.stage}" if self.stage >= 0 else "")


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return SCHEDULES[name]
    except KeyError:
        raise ConfigError(f"--schedule: unknown schedule '{name}'; known: {', '.join(SCHEDULES)}") from None


def torch_schedule_class(name: str) -> type:
    """The installed torch's class for ``name``; a ConfigError if this torch lacks it."""
    import torch
    from torch.distributed.pipelining import schedules

    info = schedule_info(name)
    found = getattr(schedules, info.torch_class, None)
    if found is None:
        raise ConfigError(f"--schedule {name}: the installed torch {torch.__version__} has no "
                          f"torch.distributed.pipelining.{info.torch_class}; pick one of "
                          f"{', '.join(n for n, i in SCHEDULES.items() if hasattr(schedules, i.torch_class))}")
    return found


def check_schedule(name: str, stages: int, microbatches: int) -> ScheduleInfo:
    """The limits torch's schedules put on P and M, as one ConfigError line before any process starts."""
    info = schedule_info(name)
    torch_schedule_class(name)
    if stages < 2:
        raise ConfigError(f"--stages {stages}: a pipeline needs at least 2 stages")
    if name == "1f1b" and microbatches < stages:
        raise ConfigError(f"--schedule 1f1b needs --microbatches >= --stages ({microbatches} < {stages}); "
                          "pass more micro-batches or --schedule gpipe")
    if info.chunks > 1:
        rounds = max(1, microbatches // stages)
        if microbatches % rounds:
            raise ConfigError(f"--schedule {name} needs --microbatches below --stages or a multiple of it "
                              f"({microbatches} with {stages} stages)")
    return info


def stage_rank(stage: int, ranks: int, placement: str) -> int:
    """The rank that runs virtual stage ``stage``."""
    if placement == "v":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def rank_stages(rank: int, ranks: int, chunks: int, placement: str) -> list[int]:
    """The virtual stages of ``rank``, in increasing order."""
    return sorted(s for s in range(ranks * chunks) if stage_rank(s, ranks, placement) == rank)


# -- the action lists --------------------------------------------------------------------------------

def actions(name: str, ranks: int, microbatches: int) -> list[list[Action]]:
    """Per rank, the ordered actions of one optimizer step (no idle slots: a rank waits for its inputs)."""
    info = check_schedule(name, ranks, microbatches)
    if name == "gpipe":
        return [[Action("F", r, m) for m in range(microbatches)] + [Action("B", r, m) for m in range(microbatches)]
                for r in range(ranks)]
    if name == "1f1b":
        return [_one_f_one_b(r, ranks, microbatches) for r in range(ranks)]
    if name == "interleaved-1f1b":
        return [_interleaved(r, ranks, microbatches, info.chunks) for r in range(ranks)]
    return _from_torch(info, ranks, microbatches)


def _one_f_one_b(rank: int, ranks: int, microbatches: int) -> list[Action]:
    # Schedule1F1B: min(M, P - rank) forwards first, then backward/forward pairs, then the remaining backwards
    warmup = min(microbatches, ranks - rank)
    out = [Action("F", rank, m) for m in range(warmup)]
    forward = warmup
    for backward in range(microbatches):
        out.append(Action("B", rank, backward))
        if forward < microbatches:
            out.append(Action("F", rank, forward))
            forward += 1
    return out


def _interleaved(rank: int, ranks: int, microbatches: int, chunks: int) -> list[Action]:
    # ScheduleInterleaved1F1B (Megatron's depth-first order, "flexible" rounds of M // P micro-batches)
    per_round = microbatches // max(1, microbatches // ranks)
    warmup = min((chunks - 1) * per_round + 2 * (ranks - 1 - rank), microbatches * chunks)
    total = microbatches * chunks

    def forward_stage(op: int) -> int:
        return ((op // per_round) % chunks) * ranks + rank

    def backward_stage(op: int) -> int:
        return (chunks - 1 - ((op - warmup) // per_round) % chunks) * ranks + rank

    done_f: dict[int, int] = {}
    done_b: dict[int, int] = {}
    out: list[Action] = []
    for op in range(total + warmup):
        if op < total:
            s = forward_stage(op)
            out.append(Action("F", s, done_f.get(s, 0)))
            done_f[s] = done_f.get(s, 0) + 1
        if op >= warmup:
            s = backward_stage(op)
            out.append(Action("B", s, done_b.get(s, 0)))
            done_b[s] = done_b.get(s, 0) + 1
    return out


def _from_torch(info: ScheduleInfo, ranks: int, microbatches: int) -> list[list[Action]]:
    """torch's pipeline_order for a runtime schedule, built from stand-in stage records (the constructor
    reads only these fields to plan; nothing is communicated)."""
    cls = torch_schedule_class(info.name)
    stand_ins = [SimpleNamespace(group_rank=0, group_size=ranks, num_stages=ranks * info.chunks, submod=None,
                                 stage_index=s, is_first=s == 0, is_last=s == ranks * info.chunks - 1)
                 for s in rank_stages(0, ranks, info.chunks, info.placement)]
    order = cls(stand_ins, microbatches).pipeline_order
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out = []
    for rank in range(ranks):
        steps = [a for a in order[rank] if a is not None and a.computation_type.name in kinds]
        out.append([Action(kinds[a.computation_type.name], a.stage_index, a.microbatch_index) for a in steps])
    return out


# -- timing ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Timeline:
    """Each rank's actions with start times, in unit costs."""

    ranks: int
    stages: int
    starts: list[list[tuple[int, Action]]]
    makespan: int

    @property
    def busy(self) -> list[int]:
        return [sum(COSTS[a.kind] for _, a in rank) for rank in self.starts]

    @property
    def bubble(self) -> Fraction:
        return 1 - Fraction(sum(self.busy), self.ranks * self.makespan)


def simulate(name: str, ranks: int, microbatches: int) -> Timeline:
    """Replay the action lists: each rank runs its actions in order, each as soon as its producer (the
    previous stage's forward, the next stage's backward) has ended."""
    info = schedule_info(name)
    stages = ranks * info.chunks
    lists = actions(name, ranks, microbatches)
    ended: dict[tuple[str, int, int], int] = {}
    position, free = [0] * ranks, [0] * ranks
    starts: list[list[tuple[int, Action]]] = [[] for _ in range(ranks)]
    while any(position[r] < len(lists[r]) for r in range(ranks)):
        progressed = False
        for r in range(ranks):
            if position[r] == len(lists[r]):
                continue
            action = lists[r][position[r]]
            needs = _producers(action, stages)
            if any(n not in ended for n in needs):
                continue
            start = max([free[r]] + [ended[n] for n in needs])
            starts[r].append((start, action))
            ended[(action.kind, action.stage, action.microbatch)] = free[r] = start + COSTS[action.kind]
            if action.kind == "B":  # a full backward also produces what an input backward would
                ended[("I", action.stage, action.microbatch)] = free[r]
            position[r] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} (P={ranks}, M={microbatches}) deadlocks in simulation")
    return Timeline(ranks, stages, starts, max(free))


def _producers(action: Action, stages: int) -> list[tuple[str, int, int]]:
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind == "W":
        return [("I", s, m)]
    needs = [("F", s, m)]
    if s < stages - 1:
        needs.append(("I", s + 1, m))  # a full backward of stage s+1 records its I too
    return needs


def theoretical_bubble(ranks: int, microbatches: int, chunks: int = 1) -> Fraction:
    """(P-1) / (v*M + P-1): the idle share of a fill-drain or 1F1B pipeline with equal stages."""
    return Fraction(ranks - 1, chunks * microbatches + ranks - 1)


def chart(name: str, ranks: int, microbatches: int) -> str:
    """The schedule as text: one row per time unit, one column per rank (``.`` idle), then the bubble."""
    info = schedule_info(name)
    timeline = simulate(name, ranks, microbatches)
    grid = [["." for _ in range(ranks)] for _ in range(timeline.makespan)]
    for r, rank in enumerate(timeline.starts):
        for start, action in rank:
            for t in range(start, start + COSTS[action.kind]):
                label = f"{action.kind}{action.microbatch}"
                grid[t][r] = label + (f"/s{action.stage}" if info.chunks > 1 else "")
    width = max(7, *(len(cell) for row in grid for cell in row))
    lines = [f"schedule {name}: {ranks} ranks, {microbatches} micro-batches, {info.chunks} stage(s) per rank "
             f"({timeline.stages} stages, placement {info.placement}); {info.about}",
             "costs: F=1, B=2 (I=1 + W=1) time units; '.' = idle",
             "time | " + " ".join(f"rank {r}".ljust(width) for r in range(ranks))]
    lines += [f"{t:4d} | " + " ".join(cell.ljust(width) for cell in row) for t, row in enumerate(grid)]
    theory = theoretical_bubble(ranks, microbatches, info.chunks)
    lines.append(f"bubble: simulated {float(timeline.bubble):.3f} ({timeline.bubble}), theoretical "
                 f"(P-1)/(vM+P-1) = {float(theory):.3f} ({theory})")
    return "\n".join(lines)
