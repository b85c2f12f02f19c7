"""A multilayer perceptron with configurable hidden widths.

``mlp:hidden=10`` on ``synthetic:shape=5,classes=2,task=binary`` is the 5→10→1 binary classifier of
TensorFlow's tower examples; ``mlp:hidden=256x128`` is a two-hidden-layer classifier.
"""

from __future__ import annotations

import math
from typing import Sequence

from torch import nn

from polytrain.models.deferred import UnitSequential

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}


def mlp(
    input_shape: tuple[int, ...] = (64,),
    num_classes: int = 10,
    hidden: int | Sequence[int] = (128,),
    activation: str = "relu",
) -> nn.Module:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation '{activation}' is not one of {', '.join(_ACTIVATIONS)}")
    widths = [hidden] if isinstance(hidden, int) else list(hidden)
    if any(w < 1 for w in widths):
        raise ValueError(f"hidden widths must be >= 1, got {widths}")
    layers: list[nn.Module] = [nn.Flatten()]
    fan_in = math.prod(input_shape)
    for width in widths:
        layers += [nn.Linear(fan_in, width), _ACTIVATIONS[activation]()]
        fan_in = width
    layers.append(nn.Linear(fan_in, num_classes))
    return UnitSequential(*layers)
