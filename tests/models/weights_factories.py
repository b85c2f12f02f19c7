"""Factories that give their model weights of their own, as users write them (``--model
tests.models.weights_factories:NAME``): a class with ``init_unit`` (the mixin docs/fsdp.md recommends) whose
factory loads a state_dict file, one that sets a weight after constructing the model, and one that only builds."""

from __future__ import annotations

import math

import torch
from torch import nn

from polytrain.models.deferred import UnitInit


class Net(UnitInit, nn.Module):
    """input -> flatten -> 16 -> num_classes, in two units (``body``, ``head``)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU())
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def plain(input_shape: tuple[int, ...], num_classes: int) -> Net:
    return Net(input_shape, num_classes)


def pretrained(input_shape: tuple[int, ...], num_classes: int, path: str) -> Net:
    model = Net(input_shape, num_classes)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model


def head_set(input_shape: tuple[int, ...], num_classes: int) -> Net:
    model = Net(input_shape, num_classes)
    with torch.no_grad():
        model.head.weight.fill_(0.25)
    return model
