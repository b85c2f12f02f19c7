"""A small CNN for the 8×8 handwritten digits: two 3×3 convolutions, one pool, two dense layers."""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from polytrain.models.deferred import UnitSequential


def digits_cnn(input_shape: tuple[int, ...] = (1, 8, 8), num_classes: int = 10, channels: int = 32) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(f"digits_cnn needs image inputs CxHxW, got shape {input_shape}")
    c, h, w = input_shape
    # named parts, so that placement can say --place features=cuda:0,classifier=cuda:1
    return UnitSequential(OrderedDict(
        features=nn.Sequential(
            nn.Conv2d(c, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        ),
        classifier=nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * (h // 2) * (w // 2), 128), nn.ReLU(),
            nn.Linear(128, num_classes),
        ),
    ))
