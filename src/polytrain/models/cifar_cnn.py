"""The CNN of TensorFlow's classic CIFAR-10 tutorial (cifar10.py), without its local response norm.

conv 5×5×64 → max-pool 3×3/2 → conv 5×5×64 → max-pool 3×3/2 → fc 384 → fc 192 → fc num_classes.
Works on 24×24 crops (the tutorial's distorted inputs) and on full 32×32 images.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from polytrain.models.deferred import UnitSequential


def _pooled(size: int) -> int:
    # MaxPool2d(3, stride=2, padding=1) matches TF's 'SAME' pooling: ceil(size / 2)
    return (size + 1) // 2


def cifar_cnn(input_shape: tuple[int, ...] = (3, 24, 24), num_classes: int = 10, channels: int = 64) -> nn.Module:
    if len(input_shape) != 3:
        raise ValueError(f"cifar_cnn needs image inputs CxHxW, got shape {input_shape}")
    c, h, w = input_shape
    flat = channels * _pooled(_pooled(h)) * _pooled(_pooled(w))
    # named parts, so that placement can say --place features=cuda:0,classifier=cuda:1
    return UnitSequential(OrderedDict(
        features=nn.Sequential(
            nn.Conv2d(c, channels, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
            nn.Conv2d(channels, channels, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2, padding=1),
        ),
        classifier=nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, 384), nn.ReLU(),
            nn.Linear(384, 192), nn.ReLU(),
            nn.Linear(192, num_classes),
        ),
    ))
