"""The Strategy protocol and the name registry.

A strategy decides how one model trains across processes and devices. The trainer talks to it through a
few calls, in this order every step: ``data_shard`` (once: which slice of each global batch this process
loads), ``grad_sync`` (around each micro-batch's backward: whether gradients are exchanged now),
``backward`` and ``optimizer_step``. Model set-up goes through ``prepare_model`` and saving through
``unwrap``. Strategies are chosen by name (``--strategy sync``); the trainer never asks which one it has.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Any, Callable, ClassVar, ContextManager, Iterator

import torch
from torch import nn

from polytrain.data.batches import BatchPlan, Shard, ShardedBatches
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError


class Strategy:
    """Base class with the single-process behaviour; subclasses override what differs."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: whether the strategy needs one process per worker (False: it runs in the launching process)
    multiprocess: ClassVar[bool] = False
    #: the RunConfig section holding this strategy's own options, if any
    config_section: ClassVar[str] = ""

    def __init__(self, topology: Topology, options: Any = None):
        self.topology = topology
        self.options = options

    @classmethod
    def processes(cls, workers: int) -> int:
        """How many processes to launch for ``--workers N``."""
        return workers if cls.multiprocess else 1

    @classmethod
    def check(cls, workers: int, global_batch: int, accumulate: int) -> None:
        """Validate settings before any process starts; raise ConfigError with the fix."""
        per = global_batch // cls.processes(workers)
        if per % accumulate:
            raise ConfigError(f"each worker's batch ({per}) must be divisible by --accumulate ({accumulate})")

    def data_shard(self) -> Shard:
        return Shard(0, 1)

    def step_shards(self, global_batch: int, accumulate: int, data_workers: int = 0,
                    deterministic: bool = False) -> Shard | Callable[[int], Shard]:
        """The trainer's slices: the fixed ``data_shard()``, or a function giving each step's (a strategy that
        re-splits batches as it goes). Called once, after ``prepare_model``."""
        return self.data_shard()

    def prepare_model(self, model: nn.Module) -> nn.Module:
        return model.to(self.topology.device)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        """Context for one micro-batch's backward; ``enabled=False`` defers gradient exchange."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def take_wait_seconds(self) -> float:
        """Seconds this rank spent waiting for other ranks since the last call (for per-rank throughput)."""
        return 0.0

    def describe(self) -> str:
        return f"{self.name}: {self.topology.describe()}"

    def batches(self, dataset: Any, batch_size: int, *, steps: int | None = None, epochs: int | None = None,
                seed: int = 0, start_step: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This process's part of each global batch of ``batch_size`` examples, on this process's device.

        Stops after ``steps`` optimizer steps or ``epochs`` passes (one epoch if neither is given).
        """
        plan = BatchPlan(len(dataset), batch_size, seed)
        shard = self.data_shard()
        if batch_size % shard.count:
            raise ConfigError(f"batch size {batch_size} does not divide over {shard.count} workers")
        total = steps if steps is not None else (epochs or 1) * plan.steps_per_epoch
        for step, x, y in ShardedBatches(dataset, plan, shard, self.topology.device, start_step):
            if step >= total:
                return
            yield x, y


_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name`")
    _REGISTRY[cls.name] = cls
    return cls


def available_strategies() -> list[str]:
    return sorted(_REGISTRY)


def get_strategy(name: str) -> type[Strategy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"--strategy: unknown strategy '{name}'{hint}; available: "
                          f"{', '.join(available_strategies())}") from None
