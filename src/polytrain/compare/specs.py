"""What ``polytrain compare`` runs: strategy specs (``local-sgd:sync_every=8``) and the shared budget.

A spec is a strategy name followed by its own settings, ``NAME[:KEY=VALUE[:KEY=VALUE...]]``; the keys are
the settings' names as in a config file (``sync_every``, ``staleness``, ``outer_lr``). A name may itself be
``package.module:Class``: the pieces without ``=`` make up the name. Names are not looked up here, so a
strategy registered later (or only in another engineer's branch, like ``async``) parses the same way; the
run checks every case before training any.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from polytrain.errors import ConfigError

#: the default line-up; a name that is not registered in this install is skipped with a note (not an error,
#: unless the user names it). diloco runs with its own defaults, which choose the outer momentum from the inner
#: optimizer (0.5 over the default SGD momentum 0.9: strategies/periodic.py, default_outer_momentum)
DEFAULT_STRATEGIES = "sync,async,local-sgd:sync_every=8,diloco:sync_every=8"


@dataclass(frozen=True)
class StrategySpec:
    text: str
    name: str
    settings: dict[str, str] = field(default_factory=dict)


def parse_spec(text: str) -> StrategySpec:
    pieces = [p.strip() for p in text.strip().split(":")]
    name = ":".join(p for p in pieces if "=" not in p)
    settings: dict[str, str] = {}
    for piece in pieces:
        if "=" in piece:
            key, _, value = piece.partition("=")
            key = key.strip().replace("-", "_")
            if not key or not value.strip():
                raise ConfigError(f"--strategies: '{text}': expected KEY=VALUE after the name, got '{piece}'")
            settings[key] = value.strip()
    if not name or any(p == "" for p in pieces):
        raise ConfigError(f"--strategies: '{text}': expected NAME or NAME:KEY=VALUE[:KEY=VALUE...] "
                          "(e.g. local-sgd:sync_every=8)")
    for key in ("strategy", "workers", "steps", "epochs", "batch_size", "worker_batch_size", "straggler"):
        if key in settings:
            raise ConfigError(f"--strategies: '{text}': {key} is shared by every case; set it with "
                              f"--{key.replace('_', '-')} instead")
    return StrategySpec(text.strip(), name, settings)


def parse_specs(text: str) -> list[StrategySpec]:
    specs = [parse_spec(part) for part in text.split(",") if part.strip()]
    if not specs:
        raise ConfigError("--strategies: give at least one strategy, e.g. sync,local-sgd:sync_every=8")
    texts = [s.text for s in specs]
    twice = sorted({t for t in texts if texts.count(t) > 1})
    if twice:
        raise ConfigError(f"--strategies: '{twice[0]}' is given twice")
    return specs


@dataclass
class CompareConfig:
    """The budget every case shares: same model, data, examples per worker per step, steps and evaluations."""

    strategies: str = DEFAULT_STRATEGIES
    stragglers: list[str] = field(default_factory=list)  # each case also runs with these (--straggler)
    workers: int = 2
    data: str = "digits"
    model: str = "digits_cnn"
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    worker_batch_size: int = 32
    steps: int = 240
    eval_every: int = 40
    log_every: int = 10
    seed: int = 0
    target_accuracy: float | None = 0.95
    target_loss: float | None = None
    #: rounds of every case, interleaved (case A, B, A, B...); each row's numbers are the rounds' medians
    repeats: int = 1
    #: further settings for every case, by config key (``comm=backend``, ``threads_per_worker=1``)
    extra: dict[str, Any] = field(default_factory=dict)
    #: --link: every case also (only) on an emulated network at each of these rates, bits/s (empty: off)
    links: list[int] = field(default_factory=list)

    def check(self) -> None:
        for name in ("workers", "worker_batch_size", "steps", "eval_every", "log_every", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.eval_every % self.log_every:
            # the time of an evaluation is read from the step record logged at the same step
            raise ConfigError(f"--eval-every {self.eval_every} must be a multiple of --log-every {self.log_every}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ConfigError(f"--target-accuracy must be in (0, 1], got {self.target_accuracy:g}")

    def settings(self, spec: StrategySpec, stragglers: list[str]) -> dict[str, Any]:
        """The ``polytrain.fit`` settings of one case (without its metrics file)."""
        return {
            "data": self.data, "model": self.model, "optimizer": self.optimizer, "lr": self.lr,
            "momentum": self.momentum, "workers": self.workers, "worker_batch_size": self.worker_batch_size,
            "steps": self.steps, "eval_every": self.eval_every, "log_every": self.log_every, "seed": self.seed,
            "progress": "off", **self.shared(spec.name), **spec.settings, "strategy": spec.name,
            "straggler": list(stragglers),
        }

    def shared(self, strategy: str) -> dict[str, Any]:
        """``--set``'s settings that ``strategy`` reads: one of a strategy's own (``comm=backend``: sync's)
        goes to that strategy's cases only, where a run would refuse it."""
        from polytrain.config import all_options
        from polytrain.strategies.registry import declared, get_declared
        from polytrain.strategies.settings import readers

        own = get_declared(strategy).config_section
        section = {info.key: info.section for info in all_options()}
        others = set(readers(declared())) - {own}
        return {key: value for key, value in self.extra.items() if section.get(key.replace("-", "_")) not in others}
