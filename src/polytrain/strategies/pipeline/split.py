"""Cutting a model into pipeline stages: its units, where the cuts go, and what each stage costs.

A model can be split if its forward is its units applied in order: the top-level children, with an
``nn.ModuleList`` (``transformer_lm``'s ``blocks``) counted as its items. ``transformer_lm`` gives
``embed, blocks.0 ... blocks.N-1, head``; an ``nn.Sequential`` gives ``0, 1, ...``. A stage is a run of
consecutive units, so the names of the whole model's parameters are unchanged (``blocks.2.attn.qkv.weight``)
and checkpoints move between strategies as they are.

Cuts are given by name (``--split-at blocks.2``: a stage starts at each named unit) or chosen from each
unit's **measured** forward+backward time on the worker's device (``--split-at auto``): the contiguous
split whose slowest stage is fastest (a small dynamic programme over the measured milliseconds).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass

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


def measure(model: nn.Module, sample: torch.Tensor, repeats: int = 3) -> tuple[list[float], bool]:
    """Each unit's forward+backward time in milliseconds on one micro-batch (the median of ``repeats``
    rounds over all units after a warm-up round), and whether applying the units in order gives what ``model`` gives (else the model
    cannot be split this way).

    Whatever the caller's grad mode (an evaluation runs under ``no_grad``) and the model's train/eval mode,
    the check runs in eval mode (dropout off, so both ways agree) and the timing with autograd on in train
    mode (as a training step runs); the model's modes, buffers, gradients and the RNG are left as they were."""
    parts = units(model)
    with _undisturbed(model, sample.device):
        model.eval()
        with torch.no_grad():
            x, inputs = sample, []
            for _, unit in parts:
                inputs.append(x)
                x = unit(x)
            whole = model(sample)
        same = isinstance(x, torch.Tensor) and isinstance(whole, torch.Tensor) and x.shape == whole.shape \
            and torch.allclose(x, whole, rtol=1e-4, atol=1e-5)
        if not same:  # refused whatever the times
            return [0.0] * len(parts), False
        model.train()
        with torch.enable_grad():
            times = _time_units([unit for _, unit in parts], inputs, repeats)
    return [statistics.median(kept) for kept in times], same


def _time_units(parts: list[nn.Module], inputs: list[torch.Tensor], repeats: int) -> list[list[float]]:
    """Each unit's forward+backward milliseconds in each of ``repeats`` rounds after a warm-up round.

    Round after round over all units, not unit after unit: a burst of load from other processes then
    lands on one round of every unit, which the median drops, not on all rounds of a few units."""
    times: list[list[float]] = [[] for _ in parts]
    for round_ in range(repeats + 1):  # round 0 warms up
        for unit, given, kept in zip(parts, inputs, times):
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
    ms: tuple[float, ...]  # per unit, measured
    how: str  # "measured" or "--split-at"

    def stage_units(self, stage: int) -> list[str]:
        return [self.names[i] for i in groups(list(self.cuts), len(self.names))[stage]]

    def stage_ms(self) -> list[float]:
        return [sum(self.ms[i] for i in g) for g in groups(list(self.cuts), len(self.names))]

    def describe(self, stage_rank: list[int]) -> str:
        lines = [f"pipeline split ({self.how}; forward+backward ms measured on one micro-batch):"]
        for stage, g in enumerate(groups(list(self.cuts), len(self.names))):
            names = [self.names[i] for i in g]
            span = names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"
            lines.append(f"  stage {stage} (rank {stage_rank[stage]}): {span} ({len(names)} units), "
                         f"{sum(self.params[i] for i in g):,} parameters, {sum(self.ms[i] for i in g):.2f} ms")
        ms = self.stage_ms()
        lines.append(f"  slowest/fastest stage: {max(ms) / max(min(ms), 1e-9):.2f}x")
        return "\n".join(lines)
