"""One training step, top to bottom: forward and backward over this worker's slice of the global batch.

The strategy decides what happens between workers (``grad_sync`` defers the gradient exchange to the
last micro-batch when accumulating; ``backward`` may overlap communication). The optimizer update is
done by the caller after the loss has been checked.
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.strategies.base import Strategy
from polytrain.train.tasks import Task


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, task: Task,
                     strategy: Strategy, accumulate: int = 1) -> torch.Tensor:
    """Accumulate gradients of the mean loss over ``accumulate`` equal micro-batches; return that loss."""
    total = torch.zeros((), device=inputs.device)
    micro_batches = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate)))
    for i, (x, y) in enumerate(micro_batches):
        with strategy.grad_sync(model, enabled=i == len(micro_batches) - 1):
            loss = task.loss(model(x), y) / len(micro_batches)
            strategy.backward(loss)
        total += loss.detach().to(total.device)
    return total
