"""Learning-rate schedules as data: a :class:`LRSchedule` is parsed from a compact spec and is a pure
function of the step, so it can be printed, unit-tested against its formula and restored from a step.

Specs (``--lr-schedule``)::

    constant
    exponential:rate=0.1,decay_steps=1000[,staircase=true]   lr * rate ** (step / decay_steps)  (TensorFlow)
    cosine[:min_lr=0.0]                                      half-cosine from lr to min_lr <= lr (last step)
    linear[:min_lr=0.0]                                      straight line from lr to min_lr <= lr (last step)

Every schedule also takes ``warmup=N``: the first N steps ramp linearly up to the schedule's value
(``lr * (step + 1) / N``), e.g. ``cosine:warmup=100``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import ConfigError
from polytrain.specs import parse_spec

_PARAMS: dict[str, dict[str, Any]] = {
    "constant": {},
    "exponential": {"rate": None, "decay_steps": None, "staircase": False},
    "cosine": {"min_lr": 0.0},
    "linear": {"min_lr": 0.0},
}
KINDS = tuple(_PARAMS)


@dataclass(frozen=True)
class LRSchedule:
    """``lr_at(step)`` for steps 0 .. total_steps-1."""

    kind: str
    base_lr: float
    total_steps: int
    warmup: int = 0
    params: dict[str, Any] = field(default_factory=dict)

    def lr_at(self, step: int) -> float:
        return self._decayed(step) * self._warmup_factor(step)

    __call__ = lr_at

    def _warmup_factor(self, step: int) -> float:
        return (step + 1) / self.warmup if step < self.warmup else 1.0

    def _decayed(self, step: int) -> float:
        lr, p = self.base_lr, self.params
        if self.kind == "constant":
            return lr
        if self.kind == "exponential":
            exponent = step / p["decay_steps"]
            if p["staircase"]:
                exponent = math.floor(exponent)
            return lr * p["rate"] ** exponent
        span = max(1, self.total_steps - 1 - self.warmup)  # the last step runs at min_lr
        progress = min(1.0, max(0.0, (step - self.warmup) / span))
        if self.kind == "cosine":
            return p["min_lr"] + (lr - p["min_lr"]) * 0.5 * (1.0 + math.cos(math.pi * progress))
        return lr + (p["min_lr"] - lr) * progress  # linear

    def __str__(self) -> str:
        items = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in self.params.items()]
        if self.warmup:
            items.append(f"warmup={self.warmup}")
        return self.kind + (":" + ",".join(items) if items else "")


def parse_lr_schedule(spec: str, base_lr: float, total_steps: int) -> LRSchedule:
    """Parse ``--lr-schedule``; errors name the bad part and the accepted kinds and arguments."""
    parsed = parse_spec(spec, what="--lr-schedule")
    if parsed.name not in _PARAMS:
        raise ConfigError(f"--lr-schedule: unknown schedule '{parsed.name}'; accepted: {', '.join(KINDS)}")
    if parsed.args:
        raise ConfigError("--lr-schedule: write arguments as key=value, e.g. exponential:rate=0.1,decay_steps=1000")
    accepted = _PARAMS[parsed.name]
    kwargs = dict(parsed.kwargs)
    warmup = kwargs.pop("warmup", 0)
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        names = ", ".join([*accepted, "warmup"])
        raise ConfigError(f"--lr-schedule {parsed.name}: unknown argument(s) {', '.join(unknown)}; accepted: {names}")
    params = {k: kwargs.get(k, default) for k, default in accepted.items()}
    missing = [k for k, v in params.items() if v is None]
    if missing:
        raise ConfigError(f"--lr-schedule {parsed.name}: missing {', '.join(missing)} "
                          f"(e.g. exponential:rate=0.1,decay_steps=1000)")
    _check(parsed.name, params, warmup)
    _check_floor(parsed.name, params, float(base_lr))
    return LRSchedule(parsed.name, float(base_lr), int(total_steps), int(warmup), params)


def _check(kind: str, params: dict[str, Any], warmup: Any) -> None:
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ConfigError(f"--lr-schedule {kind}: warmup must be an integer >= 0, got {warmup!r}")
    if kind == "exponential":
        if not _finite(params["rate"]) or params["rate"] <= 0:
            raise ConfigError(f"--lr-schedule exponential: rate must be a number > 0, got {params['rate']!r}")
        steps = params["decay_steps"]
        if not _finite(steps) or steps <= 0:
            raise ConfigError(f"--lr-schedule exponential: decay_steps must be > 0, got {steps!r}")
        if not isinstance(params["staircase"], bool):
            raise ConfigError(f"--lr-schedule exponential: staircase must be true or false, got {params['staircase']!r}")
    if kind in _FLOORS:
        if not _finite(params["min_lr"]) or params["min_lr"] < 0:
            raise ConfigError(f"--lr-schedule {kind}: min_lr must be a number >= 0, got {params['min_lr']!r}")


#: the schedules that decay towards a floor, and its argument: a floor above the start is no decay
_FLOORS = {"cosine": "min_lr", "linear": "min_lr"}


def _check_floor(kind: str, params: dict[str, Any], base_lr: float) -> None:
    name = _FLOORS.get(kind)
    if name is not None and params[name] > base_lr:
        raise ConfigError(f"--lr-schedule {kind}: {name} {params[name]:g} is above the learning rate {base_lr:g} "
                          f"it decays from (--lr, scaled if --lr-scaling is set); give a {name} <= {base_lr:g}, or a higher --lr")


def _finite(value: Any) -> bool:
    """A finite int or float (true/false are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def scaled_lr(lr: float, rule: str, batch_size: int, base_batch_size: int | None) -> float:
    """Large-batch learning-rate scaling (Goyal et al. 2017: linear; Krizhevsky 2014: sqrt).

    ``lr`` is the rate tuned for ``base_batch_size``; the run's global batch is ``batch_size``.
    """
    if rule == "none":
        return lr
    if not base_batch_size:
        raise ConfigError(f"--lr-scaling {rule} needs --base-batch-size (the batch size --lr was tuned for)")
    ratio = batch_size / base_batch_size
    return lr * (ratio if rule == "linear" else math.sqrt(ratio))
