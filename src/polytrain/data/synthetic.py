"""``synthetic``: random inputs of any shape and size, labelled by a fixed random "teacher".

Labels come from a random linear teacher on the inputs (``argmax`` over classes, or its sign for the
binary task), so the data is learnable and a falling loss means training works. Every example is a
pure function of ``(seed, index)``: a dataset too large for memory is generated batch by batch, and
a small one is generated once, with identical values either way.

Examples: ``synthetic`` (CIFAR-shaped 3x32x32, 10 classes), ``synthetic:shape=3x24x24,size=50000``,
``synthetic:shape=5,task=binary`` (the 5 -> 10 -> 1 tower example with ``--model mlp:hidden=10``).
"""

from __future__ import annotations

import math

import torch
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
    def __init__(self, seed: int, numel: int, num_classes: int, task: str):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + _TEACHER_STREAM)
        self.task = task
        self.weight = torch.randn(numel, 1 if task == "binary" else num_classes, generator=gen) / math.sqrt(numel)

    def __call__(self, flat_inputs: torch.Tensor) -> torch.Tensor:
        scores = flat_inputs @ self.weight
        if self.task == "binary":
            return (scores[:, 0] > 0).to(torch.float32)
        return scores.argmax(dim=1)


class SyntheticData(Dataset):
    """Examples ``offset .. offset+size-1`` of a synthetic stream, generated when asked for."""

    def __init__(self, shape: tuple[int, ...], size: int, offset: int, seed: int, teacher: _Teacher):
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
    teacher = _Teacher(seed, math.prod(dims), num_classes, task)
    return DataBundle(
        name="synthetic",
        train=_split(dims, size, 0, seed, teacher),
        test=_split(dims, test_size, size, seed, teacher) if test_size else None,
        input_shape=dims,
        num_classes=num_classes,
        task=task,
        default_model=_default_model(dims, num_classes),
    )
