"""What one training step gets back, and the default forward/backward over a slice.

A step gets a :class:`~polytrain.data.batches.Batch`: this rank's slice of one global batch, with the size
of the whole global batch in the task's units (examples, or real tokens for a language model), so every
rank can weigh its slice's loss without asking the others. :func:`forward_backward` is the step every data-parallel strategy shares:
micro-batches, each one's loss weighed by its share of the global batch, gradients exchanged (by the
strategy's ``grad_sync``/``backward``) after the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from polytrain.data.batches import Batch


@dataclass(frozen=True)
class StepRecipe:
    """How a step computes its update, whatever the strategy: the task's loss, gradient accumulation over
    ``accumulate`` micro-batches, and clipping of the *global* gradient's norm (after the exchange)."""

    task: Any = None
    accumulate: int = 1
    clip_grad_norm: float | None = None


@dataclass
class StepResult:
    """What a rank reports of one step. ``loss`` is this rank's share of the global batch's mean loss, such
    that the mean over the ranks that hold a loss is that mean loss (a detached tensor on the device, read
    only at log points); ``None`` on a rank that computes no loss (a pipeline's first stages, a server)."""

    loss: torch.Tensor | None
    examples: int


def loss_divisor(global_units: int, replicas: int, units: int) -> float:
    """What the mean loss of a micro-batch of ``units`` is divided by so that it weighs its share of a global
    batch of ``global_units``, when the exchange averages the gradients of ``replicas`` ranks."""
    return global_units / (replicas * max(units, 1))


def forward_backward(model: nn.Module, batch: Batch, task: Any, replicas: int, accumulate: int,
                     grad_sync: Callable[[nn.Module, bool], ContextManager[Any]],
                     backward: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """Gradients of the global batch's mean loss over this slice, in ``accumulate`` micro-batches.

    The gradients of ``replicas`` data-parallel ranks are averaged by the exchange, so a micro-batch holding
    ``u`` of the global batch's ``U`` units divides its mean loss by ``U / (replicas * u)``: the average is
    then the gradient of the mean over all ``U`` units, whatever the slices hold. For equal slices of
    examples in K micro-batches the divisor is exactly K. Returns the summed, weighed loss (detached).
    """
    total = torch.zeros((), device=batch.inputs.device)
    pieces = list(zip(batch.inputs.chunk(accumulate), batch.targets.chunk(accumulate)))
    for i, (x, y) in enumerate(pieces):
        with grad_sync(model, i == len(pieces) - 1):
            loss = task.loss(model(x), y) / loss_divisor(batch.global_units, replicas, task.units(y))
            backward(loss)
        total += loss.detach().to(total.device)
    return total
