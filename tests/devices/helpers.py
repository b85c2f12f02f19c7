"""Shared pieces of the device tests: a log-record collector and a small two-part model."""

from __future__ import annotations

import logging

import torch
from torch import nn


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


class Net(nn.Module):
    """features (Linear, ReLU) then classifier (Linear): the shape of the background articles' examples."""

    def __init__(self, inputs: int = 4, hidden: int = 8, classes: int = 3):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU())
        self.classifier = nn.Sequential(nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def loss_and_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward/backward; the targets go where the output is, as the trainer does."""
    model.zero_grad(set_to_none=True)
    out = model(x)
    loss = nn.functional.cross_entropy(out, y.to(out.device))
    loss.backward()
    return loss.item(), {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
