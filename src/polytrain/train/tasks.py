"""What a model's outputs are scored against: the loss and the accuracy for each kind of task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from polytrain.errors import ConfigError


@dataclass(frozen=True)
class Task:
    """``loss`` returns the mean over the batch; ``score`` returns (summed loss, correct count)."""

    name: str
    loss_fn: Callable[..., torch.Tensor]
    predict: Callable[[torch.Tensor], torch.Tensor]
    prepare_targets: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(outputs, self.prepare_targets(outputs, targets))

    @torch.no_grad()
    def score(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prepared = self.prepare_targets(outputs, targets)
        summed = self.loss_fn(outputs, prepared, reduction="sum")
        predicted = self.predict(outputs)
        correct = (predicted == prepared.view_as(predicted)).sum()
        return summed, correct


def _classification_targets(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return targets.to(outputs.device, torch.long, non_blocking=True)


def _binary_targets(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return targets.to(outputs.device, outputs.dtype, non_blocking=True).view_as(outputs)


TASKS = {
    "classification": Task("classification", F.cross_entropy, lambda out: out.argmax(dim=-1),
                           _classification_targets),
    "binary": Task("binary", F.binary_cross_entropy_with_logits, lambda out: (out > 0).to(out.dtype),
                   _binary_targets),
}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task '{name}'; accepted: {', '.join(TASKS)}") from None
