"""Cutting a model into pipeline stages: its units, where the cuts go, and what each stage costs.

A model can be split if its forward is its units applied in order: the top-level children, with an
``nn.ModuleList`` (``transformer_lm``'s ``blocks``) counted as its items. ``transformer_lm`` gives
``embed, blocks.0 ... blocks.N-1, head``; an ``nn.Sequential`` gives ``0, 1, ...``. A stage is a run of
consecutive units, so the names of the whole model's parameters are unchanged (``blocks.2.attn.qkv.weight``)
and checkpoints move between strategies as they are.

Cuts are given by name (``--split-at blocks.2``: a stage starts at each named unit; nothing is timed) or
chosen from each unit's **measured** forward+backward time on the worker's device (``--split-at auto``): the
contiguous split whose slowest stage is fastest (a small dynamic programme over the measured milliseconds).
A model built on the meta device is measured one unit at a time, each made only while it runs.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.models.parts import units  # noqa: F401  (a model's units: where a pipeline cuts)


def parse_split(text: str) -> list[str] | None:
    """``auto`` (None) or the unit names that start stages 1, 2, ..."""
    text = text.strip()
    if text in ("", "auto"):
        return None
    return [name.strip() for name in text.split(",") if name.strip()]


def cuts_from_names(names: list[str], starts: list[str], stages: int) -> list[int]:
    """Unit indices where stages 1..S-1 begin, from ``--split-at`` names; one ConfigError line if wrong."""
    if len(starts) != stages - 1:
        raise ConfigError(f"--split-at {','.join(starts)}: {stages} stages need {stages - 1} split point(s), "
                          f"got {len(starts)}")
    cuts = []
    for start in starts:
        if start not in names:
            raise ConfigError(f"--split-at {start}: no such unit; the model's units are {', '.join(names)}")
        cuts.append(names.index(start))
    if cuts != sorted(set(cuts)) or cuts[0] == 0:
        raise ConfigError(f"--split-at {','.join(starts)}: split points must be increasing and after the "
                          f"first unit ({names[0]})")
    return cuts


def check_splittable(names: list[str], stages: int, what: str) -> None:
    if stages > len(names):
        raise ConfigError(f"{what}: {stages} stages but the model has only {len(names)} splittable units "
                          f"({', '.join(names)}); use fewer stages or a deeper model")


def balanced_cuts(costs: list[float], stages: int) -> list[int]:
    """Unit indices where stages 1..S-1 begin, minimising the slowest stage's summed cost (ties: the
    earliest cuts); every stage gets at least one unit."""
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: the smallest max-stage cost of splitting units[:i] into k stages; back[k][i]: the last cut
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-12:
                    best[k][i], back[k][i] = value, j
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = back[k][i]
        cuts.append(i)
    return sorted(cuts)


def groups(cuts: list[int], count: int) -> list[range]:
    """The unit index ranges of each stage."""
    bounds = [0, *cuts, count]
    return [range(bounds[s], bounds[s + 1]) for s in range(len(bounds) - 1)]


def measure(model: nn.Module, sample: torch.Tensor, repeats: int = 3, *, timed: bool = True,
            resident: Callable[[str], ContextManager[Any]] | None = None) -> tuple[list[float], bool]:
    """Each unit's forward+backward time in milliseconds on one micro-batch (the median of ``repeats``
    rounds over all units after a warm-up round; zeros when not ``timed``), and whether the model's forward
    is its units applied in order (else the model cannot be split this way).

    ``resident(name)``, where given, is a context in which unit ``name`` holds real tensors (a model built on
    the meta device, made one unit at a time): each unit is then made only while it runs, so no more than one
    is held at once beyond those already made.

    Whatever the caller's grad mode (an evaluation runs under ``no_grad``) and the model's train/eval mode,
    the check runs in eval mode (dropout off, so both ways agree) and the timing with autograd on in train
    mode (as a training step runs); the model's modes, buffers, gradients and the RNG are left as they were."""
    parts = units(model)
    hold = resident or (lambda name: contextlib.nullcontext())
    with _undisturbed(model, sample.device):
        model.eval()
        with torch.no_grad():
            inputs, same = _traced(model, sample, parts, hold)
        if not same or not timed:  # refused whatever the times
            return [0.0] * len(parts), same
        model.train()
        with torch.enable_grad():
            times = _time_units(parts, inputs, repeats, hold)
    return [statistics.median(kept) for kept in times], same


class _Traced(nn.Module):
    """Stands in for one unit during :func:`_traced`: holds it resident, calls it, records the call. While
    the unit is made and runs, the model holds the unit itself again (so making it by name finds it)."""

    def __init__(self, index: int, name: str, slot: tuple[nn.Module, str, nn.Module], calls: list,
                 hold: Callable[[str], Any]):
        super().__init__()
        object.__setattr__(self, "_call", (index, name, slot, calls, hold))  # not a sub-module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        index, name, (parent, leaf, unit), calls, hold = self._call
        parent._modules[leaf] = unit
        try:
            with hold(name):
                out = unit(*args, **kwargs)
        finally:
            parent._modules[leaf] = self
        alone = args and all(a is None for a in args[1:]) and all(v is None for v in kwargs.values())
        calls.append((index, args[0] if alone else None, out))  # (optional inputs left as None: the chain's call)
        return out

    def __getattr__(self, attr: str) -> Any:  # a forward that reads a unit's attribute still sees the unit's
        try:
            return super().__getattr__(attr)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_call")[2][2], attr)


def _traced(model: nn.Module, sample: torch.Tensor, parts: list[tuple[str, nn.Module]],
            hold: Callable[[str], Any]) -> tuple[list[torch.Tensor], bool]:
    """``model(sample)`` with each unit's call recorded (and the unit held resident while it runs): the
    input each unit was given, and whether the forward was the units applied in order (each called once, in
    order, the first on ``sample``, each on the output of the one before, the last's output the model's)."""
    calls: list[tuple[int, Any, Any]] = []
    slots = []
    for index, (name, unit) in enumerate(parts):
        parent_name, _, leaf = name.rpartition(".")
        slot = (model.get_submodule(parent_name), leaf, unit)
        slots.append(slot)
        slot[0]._modules[leaf] = _Traced(index, name, slot, calls, hold)
    try:
        whole = model(sample)
    finally:
        for parent, leaf, unit in slots:
            parent._modules[leaf] = unit
    inputs = [given for _, given, _ in calls]
    same = [index for index, _, _ in calls] == list(range(len(parts))) and _close(inputs[0], sample) and \
        all(_close(inputs[i], calls[i - 1][2]) for i in range(1, len(calls))) and _close(calls[-1][2], whole)
    return inputs, same


def _close(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are real tensors of one shape and dtype with (nearly) equal values."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.is_meta or b.is_meta:
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    return a is b or torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)


def _time_units(parts: list[tuple[str, nn.Module]], inputs: list[torch.Tensor], repeats: int,
                hold: Callable[[str], Any]) -> list[list[float]]:
    """Each unit's forward+backward milliseconds in each of ``repeats`` rounds after a warm-up round (each
    unit held resident for its turn; the making is not timed).

    Round after round over all units, not unit after unit: a burst of load from other processes then
    lands on one round of every unit, which the median drops, not on all rounds of a few units."""
    times: list[list[float]] = [[] for _ in parts]
    for round_ in range(repeats + 1):  # round 0 warms up
        for (name, unit), given, kept in zip(parts, inputs, times):
            with hold(name):
                x = given.detach().requires_grad_(given.is_floating_point())
                start = time.perf_counter()
                out = unit(x)
                out.backward(torch.ones_like(out))
                if out.device.type == "cuda":
                    torch.cuda.synchronize(out.device)
                if round_:
                    kept.append((time.perf_counter() - start) * 1e3)
    return times


@contextlib.contextmanager
def _undisturbed(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore, on leaving, each module's train/eval mode, the buffers (BatchNorm statistics), the
    parameters' gradients and the random streams (CPU's and ``device``'s): measuring changes no training."""
    modes = [(module, module.training) for module in model.modules()]
    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    grads = [(param, param.grad) for param in model.parameters()]
    for param, _ in grads:
        param.grad = None
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
        for param, grad in grads:
            param.grad = grad


@dataclass(frozen=True)
class Split:
    """Which units each stage holds, with their parameters and measured milliseconds (plain data)."""

    names: tuple[str, ...]
    cuts: tuple[int, ...]
    params: tuple[int, ...]  # per unit
    ms: tuple[float, ...]  # per unit, measured (zeros for a split given by name: not timed)
    how: str  # "measured" or "--split-at"

    def stage_units(self, stage: int) -> list[str]:
        return [self.names[i] for i in groups(list(self.cuts), len(self.names))[stage]]

    def stage_ms(self) -> list[float]:
        return [sum(self.ms[i] for i in g) for g in groups(list(self.cuts), len(self.names))]

    def describe(self, stage_rank: list[int]) -> str:
        timed = self.how == "measured"
        what = "forward+backward ms measured on one micro-batch" if timed else "not timed"
        lines = [f"pipeline split ({self.how}; {what}):"]
        for stage, g in enumerate(groups(list(self.cuts), len(self.names))):
            names = [self.names[i] for i in g]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            ms = f", {sum(self.ms[i] for i in g):.2f} ms" if timed else ""
            lines.append(f"  stage {stage} (rank {stage_rank[stage]}): {span} ({len(names)} units), "
                         f"{sum(self.params[i] for i in g):,} parameters{ms}")
        if timed:
            ms = self.stage_ms()
            lines.append(f"  slowest/fastest stage: {max(ms) / max(min(ms), 1e-9):.2f}x")
        return "\n".join(lines)


def check_split(model: nn.Module, stages: int, split_at: str) -> list[str]:
    names = [name for name, _ in units(model)]
    check_splittable(names, stages, f"--stages/--schedule ({stages} stages in all)")
    starts = parse_split(split_at)
    if starts is not None:
        cuts_from_names(names, starts, stages)
    own = [n for n, _ in model.named_parameters(recurse=False)] + [n for n, _ in model.named_buffers(recurse=False)]
    if own:
        raise ConfigError(f"the model holds tensors outside its units ({', '.join(own)}); a pipeline splits "
                          "only models whose forward is their children in order")
    return names


def choose_split(model: nn.Module, sample: torch.Tensor, stages: int, split_at: str,
                 resident: Any = None) -> Split:
    """Check on ``sample`` that the model's forward is its units in order, then cut where ``split_at`` says,
    or where the cost measured on ``sample`` is balanced (``auto``); the model and the RNG are left as they
    were, so training is unchanged. ``resident``: see :func:`.measure` (a model made unit by unit)."""
    names = check_split(model, stages, split_at)
    starts = parse_split(split_at)
    ms, same = measure(model, sample, timed=starts is None, resident=resident)
    if not same:
        raise ConfigError("the model's forward is not its units applied in order "
                          f"({', '.join(names)}); a pipeline can split only such models")
    cuts = cuts_from_names(names, starts, stages) if starts else balanced_cuts(ms, stages)
    return _made(model, names, cuts, ms, "--split-at" if starts else "measured")


def named_split(model: nn.Module, stages: int, split_at: str) -> Split:
    """The split ``--split-at UNITS`` names, without running the model."""
    names = check_split(model, stages, split_at)
    cuts = cuts_from_names(names, parse_split(split_at), stages)
    return _made(model, names, cuts, [0.0] * len(names), "--split-at")


def _made(model: nn.Module, names: list[str], cuts: list[int], ms: list[float], how: str) -> Split:
    params = tuple(sum(p.numel() for p in unit.parameters()) for _, unit in units(model))
    return Split(tuple(names), tuple(cuts), params, tuple(ms), how)
