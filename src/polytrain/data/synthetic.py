"""``synthetic``: random inputs of any shape and size, labelled by a fixed random "teacher".

Labels come from a fixed random teacher (``argmax`` over classes, or its sign for the binary task), so
the data is learnable and a falling loss means training works. Images (3-D shapes C×H×W) get a small
convolutional teacher, which convolutional models learn (a linear teacher on the flattened pixels is a
function that convolution and pooling throw away: the CIFAR CNN's loss went 2.30 -> 2.28 in 400 steps);
other shapes get a linear teacher. Every example is a pure function of ``(seed, index)``: a dataset too
large for memory is generated batch by batch, and a small one is generated once, with identical values
either way (the teacher computes in float64, whose CPU convolution does not depend on the batch).

Examples: ``synthetic`` (CIFAR-shaped 3x32x32, 10 classes), ``synthetic:shape=3x24x24,size=50000``,
``synthetic:shape=5,task=binary`` (the 5 -> 10 -> 1 tower example with ``--model mlp:hidden=10``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from polytrain.data.base import TASKS, DataBundle, TensorData, example_uniform
from polytrain.errors import DataError

MATERIALIZE_LIMIT = 1 << 25  # floats kept in memory at most (128 MiB); larger sets stream
_TEACHER_STREAM = 7919


def _normals(seed: int, indices: torch.Tensor, numel: int) -> torch.Tensor:
    """Standard normal inputs (Box-Muller), shape ``(len(indices), numel)``, fixed by seed and index."""
    u1 = example_uniform(seed, 0, indices, stream=1, count=numel).clamp_min_(1e-7)
    u2 = example_uniform(seed, 0, indices, stream=2, count=numel)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2.0 * math.pi * u2)


class _Teacher:
    """A random linear map of the flattened inputs, then argmax (or sign)."""

    def __init__(self, seed: int, numel: int, num_classes: int, task: str):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _TEACHER_STREAM)
        self.task = task
        self.weight = torch.randn(numel, 1 if task == "binary" else num_classes, generator=gen) / math.sqrt(numel)

    def __call__(self, flat_inputs: torch.Tensor) -> torch.Tensor:
        return _labels(flat_inputs @ self.weight, self.task)


class _ConvTeacher:
    """Random unit-norm filters, without padding: on N(0, 1) inputs every position's response to filter k
    is N(bias_k, 1). Then ReLU, the mean over positions, centred and scaled by the ReLU's exact mean and
    spread (so that no feature dominates), a random linear map and argmax (or sign). A CNN's
    first convolution can hold the filters exactly; the pooling and classifier learn the rest."""

    FILTERS, KERNEL = 16, 3

    def __init__(self, seed: int, shape: tuple[int, ...], num_classes: int, task: str):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _TEACHER_STREAM)
        channels, height, width = shape
        kernel = min(self.KERNEL, height, width)
        filters = torch.randn(self.FILTERS, channels, kernel, kernel, generator=gen, dtype=torch.float64)
        self.filters = filters / filters.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        # biases around +1: most positions respond, so max-pooling students see most of what the mean sums
        # (centred at 0 the CIFAR CNN learned it more slowly: loss ratio 0.54-0.66 against 0.37-0.56)
        self.bias = 1.0 + 0.5 * torch.randn(self.FILTERS, generator=gen, dtype=torch.float64)
        self.mean, self.std = _relu_moments(self.bias)
        outputs = 1 if task == "binary" else num_classes
        weight = torch.randn(self.FILTERS, outputs, generator=gen, dtype=torch.float64)
        self.weight = weight / weight.norm(dim=0)  # equal norms: no class wins by a longer weight vector
        self.shape, self.task = shape, task

    def __call__(self, flat_inputs: torch.Tensor) -> torch.Tensor:
        images = flat_inputs.to(torch.float64).view(-1, *self.shape)
        pooled = F.conv2d(images, self.filters, self.bias).relu_().mean(dim=(2, 3))
        return _labels((pooled - self.mean) / self.std @ self.weight, self.task)


def _relu_moments(mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation of relu(h) for h ~ N(mean, 1)."""
    normal = torch.distributions.Normal(0.0, 1.0)
    cdf, pdf = normal.cdf(mean), normal.log_prob(mean).exp()
    first = mean * cdf + pdf
    second = (mean**2 + 1) * cdf + mean * pdf
    return first, (second - first**2).sqrt()


def _labels(scores: torch.Tensor, task: str) -> torch.Tensor:
    if task == "binary":
        return (scores[:, 0] > 0).to(torch.float32)
    return scores.argmax(dim=1)


def _teacher(seed: int, shape: tuple[int, ...], num_classes: int, task: str):
    if len(shape) == 3:
        return _ConvTeacher(seed, shape, num_classes, task)
    return _Teacher(seed, math.prod(shape), num_classes, task)


class SyntheticData(Dataset):
    """Examples ``offset .. offset+size-1`` of a synthetic stream, generated when asked for."""

    def __init__(self, shape: tuple[int, ...], size: int, offset: int, seed: int, teacher: _Teacher | _ConvTeacher):
        self.shape, self.size, self.offset, self.seed, self.teacher = shape, size, offset, seed, teacher

    def __len__(self) -> int:
        return self.size

    def get_batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        flat = _normals(self.seed, indices.to(torch.int64) + self.offset, math.prod(self.shape))
        return flat.view(len(indices), *self.shape), self.teacher(flat)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def materialize(self) -> TensorData:
        x, y = self.get_batch(torch.arange(self.size))
        return TensorData(x, y)


def _split(shape, size, offset, seed, teacher) -> Dataset:
    data = SyntheticData(shape, size, offset, seed, teacher)
    return data.materialize() if size * math.prod(shape) <= MATERIALIZE_LIMIT else data


def _default_model(shape: tuple[int, ...], num_classes: int) -> str:
    if len(shape) == 3 and shape[0] == 3 and shape[1] == shape[2] and shape[1] in (24, 32):
        return "cifar_cnn"
    if len(shape) == 3 and shape[1:] == (8, 8):
        return "digits_cnn"
    return "mlp"


def _as_shape(shape) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape) if isinstance(shape, (tuple, list)) else None
    if not dims or any(not isinstance(d, int) or d < 1 for d in dims):
        raise DataError(f"synthetic: shape must be positive integers such as 3x32x32 or 20, got '{shape}'")
    return dims


def check_synthetic(shape=(3, 32, 32), classes: int = 10, size: int = 1024, test_size: int = 256,
                    seed: int = 0, task: str = "classification") -> int:
    """Validate the arguments; return the number of training examples."""
    _as_shape(shape)
    if task not in TASKS:
        raise DataError(f"synthetic: task must be one of {', '.join(TASKS)}, got '{task}'")
    if task == "classification" and (not isinstance(classes, int) or classes < 2):
        raise DataError(f"synthetic: classes must be an integer >= 2, got {classes}")
    if not isinstance(size, int) or size < 1:
        raise DataError(f"synthetic: size must be an integer >= 1, got {size}")
    if not isinstance(test_size, int) or test_size < 0:
        raise DataError(f"synthetic: test_size must be an integer >= 0, got {test_size}")
    if not isinstance(seed, int):
        raise DataError(f"synthetic: seed must be an integer, got {seed}")
    return size


def synthetic(shape=(3, 32, 32), classes: int = 10, size: int = 1024, test_size: int = 256,
              seed: int = 0, task: str = "classification") -> DataBundle:
    """``size`` training and ``test_size`` test examples of ``shape``; ``seed`` fixes the data (not the run)."""
    check_synthetic(shape, classes, size, test_size, seed, task)
    dims = _as_shape(shape)
    num_classes = 2 if task == "binary" else classes
    teacher = _teacher(seed, dims, num_classes, task)
    return DataBundle(
        name="synthetic",
        train=_split(dims, size, 0, seed, teacher),
        test=_split(dims, test_size, size, seed, teacher) if test_size else None,
        input_shape=dims,
        num_classes=num_classes,
        task=task,
        default_model=_default_model(dims, num_classes),
    )
