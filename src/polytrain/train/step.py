"""One training step, top to bottom: forward and backward over this worker's slice of the global batch.

The strategy decides what happens between workers (``grad_sync`` defers the gradient exchange to the
last micro-batch when accumulating; ``backward`` may overlap communication). The optimizer update is
done by the caller after the loss has been checked.
"""

from __future__ import annotations

import torch
from torch import nn

from polytrain.strategies.balance import loss_divisor
from polytrain.strategies.base import Strategy
from polytrain.train.tasks import Task


def forward_backward(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, task: Task,
                     strategy: Strategy, accumulate: int = 1, equal_slice: int | None = None) -> torch.Tensor:
    """Accumulate gradients of the mean loss over ``accumulate`` equal micro-batches; return that loss.

    ``equal_slice`` is what each worker would get of an equally split global batch: a slice of another size
    (a balanced split) weighs its loss by its size against it, so the workers' averaged gradients stay
    the gradient of the mean loss over the whole global batch (and the returned loss, averaged over the
    workers, its mean loss).
    """
    total = torch.zeros((), device=inputs.device)
    equal_slice = equal_slice or len(inputs)
    micro_batches = list(zip(inputs.chunk(accumulate), targets.chunk(accumulate)))
    for i, (x, y) in enumerate(micro_batches):
        with strategy.grad_sync(model, enabled=i == len(micro_batches) - 1):
            loss = task.loss(model(x), y) / loss_divisor(equal_slice, len(y))
            strategy.backward(loss)
        total += loss.detach().to(total.device)
    return total
