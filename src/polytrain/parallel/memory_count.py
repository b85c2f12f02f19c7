"""What a rank holds, counted without memory: each tensor's shape and bytes from the model built on the meta
device, the optimizer's state from the optimizer itself, and :class:`Count`, the sums every axis's and every
strategy's estimate is made of (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from polytrain.distributed.layout import Layout
from polytrain.parallel.memory_saved import Forward, Inputs, saved_bytes


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


@dataclass(frozen=True)
class TensorSize:
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


def tensor_sizes(module: nn.Module, prefix: str = "") -> list[TensorSize]:
    """Every parameter and buffer of ``module`` (on the meta device: no memory), names under ``prefix``."""
    params = [TensorSize(prefix + n, tuple(p.shape), p.element_size(), p.requires_grad)
              for n, p in module.named_parameters()]
    buffers = [TensorSize(prefix + n, tuple(b.shape), b.element_size(), False) for n, b in module.named_buffers()]
    return params + buffers


@dataclass
class Count:
    """One estimate's inputs (the config, its layout, the meta model and its tensors, the optimizer's state per
    element size, a micro-batch's shapes, ...) and the sums every axis's and strategy's estimate uses; ``notes``
    collects what each part says about its figures."""

    config: Any
    layout: Layout
    model: nn.Module
    tensors: list[TensorSize]
    optimizers: dict[int, OptimizerState]
    inputs: Inputs
    task: Any
    device: torch.device
    data: int | None
    name: str
    traits: Any  # the running strategy's (polytrain.strategies.traits.Traits): the copies it keeps, ...
    forward: Forward = Forward()
    notes: list[str] = field(default_factory=list)

    @property
    def param_names(self) -> set[str]:
        return {name for name, _ in self.model.named_parameters()}

    # -- sums over tensors ---------------------------------------------------------------------------

    def params(self, tensors: list[TensorSize]) -> int:
        return sum(t.bytes for t in tensors)

    def grads(self, tensors: list[TensorSize]) -> int:
        return sum(t.bytes for t in tensors if t.trained)

    def state(self, tensors: list[TensorSize], stepped: bool = True) -> int:
        return sum(self.optimizers[t.element_size].bytes(t.numel, stepped) for t in tensors if t.trained)

    def rank(self, rank: int, holds: str, tensors: list[TensorSize], activations: int | None,
             **more: Any) -> RankMemory:
        return RankMemory(rank, self.layout.role(rank), holds, self.params(tensors), self.grads(tensors),
                          self.state(tensors), activations, data=self.data, **more)

    # -- what every axis asks ------------------------------------------------------------------------

    def micro_batch(self) -> int:
        cfg, layout = self.config, self.layout
        if layout.axis("pp") > 1:
            return cfg.global_batch(layout.slices) // layout.axis("dp") // cfg.pipeline.microbatches
        return max(1, cfg.global_batch(layout.slices) // layout.slices // cfg.train.accumulate)

    def activations(self, stages: list[list[str]] | None = None) -> list[int] | None:
        found, why = saved_bytes(self.model, stages, self.inputs, self.micro_batch(), self.task, self.device,
                                 self.forward)
        if why:
            self.notes.append(f"activations {why}")
        return found
