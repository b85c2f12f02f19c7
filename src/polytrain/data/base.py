"""What every dataset hands to the trainer: a :class:`DataBundle` of a train and a test split.

In-memory datasets (:class:`TensorData`) expose ``get_batch(indices, epoch)``, which gathers a whole batch
with one indexing op instead of one ``__getitem__`` per example; the trainer uses it when present and falls
back to a ``DataLoader`` for any other map-style ``torch.utils.data.Dataset``.

Random augmentation must not depend on which worker loads an example, or sharded training would differ
from single-device training. :func:`example_uniform` therefore derives each example's random numbers
from ``(seed, epoch, example index)`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch.utils.data import Dataset

TASKS = ("classification", "binary", "lm")


@dataclass
class DataBundle:
    """A dataset ready for training.

    ``task`` chooses the loss: ``classification`` (cross-entropy over ``num_classes`` logits, integer
    targets), ``binary`` (one logit, float 0/1 targets, binary cross-entropy) or ``lm`` (next-token
    prediction: (batch, time) token inputs and targets, ``num_classes`` = the vocabulary). Language-model
    data also sets ``vocab_size`` and ``seq_len`` (the longest sequence of either split), and its datasets
    have ``count_units(indices)``: the real (non-padding) target tokens of those examples.
    """

    name: str
    train: Dataset
    test: Dataset | None
    input_shape: tuple[int, ...]
    num_classes: int
    task: str = "classification"
    default_model: str = "mlp"
    vocab_size: int | None = None
    seq_len: int | None = None
    #: batches of examples of similar length, sorted within windows of this many global batches (None: off)
    bucket_window: int | None = None
    #: packed documents (``--pack``): the token that ends each document, after which the model's position ids
    #: restart (None: not packed)
    document_end: int | None = None

    @property
    def streamed(self) -> bool:
        """Whether the training split is a stream (read as training goes: no length, no indexing)."""
        return not hasattr(self.train, "__len__")

    def shape_example(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One training example (input, target), for what needs its shapes and dtypes only (a stream's: zeros
        of its rows' shape, nothing read)."""
        if self.streamed:
            row = torch.zeros(self.seq_len or 1, dtype=torch.int64)
            return row, row
        return self.train[0]

    @property
    def num_outputs(self) -> int:
        """Width of the model's last layer."""
        return 1 if self.task == "binary" else self.num_classes

    def describe(self) -> str:
        test = len(self.test) if self.test is not None else 0
        if self.task == "lm" and self.streamed:
            return (f"{self.name}: {self.train.describe()}, vocabulary {self.vocab_size}; {test} test sequences")
        if self.task == "lm":
            packed = getattr(self.train, "efficiency", None) if self.document_end is not None else None
            return (f"{self.name}: {len(self.train)} train / {test} test sequences of up to {self.seq_len} tokens, "
                    f"vocabulary {self.vocab_size}" +
                    (f"; documents packed, {packed():.1%} of the positions real tokens" if packed else ""))
        shape = "x".join(map(str, self.input_shape))
        return f"{self.name}: {len(self.train)} train / {test} test examples, input {shape}, {self.num_classes} classes"


class BatchTransform(Protocol):
    """Maps a batch of stored inputs to model inputs; may use per-example randomness."""

    def __call__(self, inputs: torch.Tensor, indices: torch.Tensor, epoch: int) -> torch.Tensor: ...


class TensorData(Dataset):
    """An in-memory dataset: stored ``inputs``/``targets`` tensors plus an optional batch transform.

    ``inputs`` may be kept compact (e.g. ``uint8`` pixels); ``transform`` turns a gathered batch into float
    model inputs. ``get_batch`` is the fast path; ``__getitem__`` exists so a ``DataLoader`` works too.
    """

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, transform: BatchTransform | None = None):
        if len(inputs) != len(targets):
            raise ValueError(f"inputs ({len(inputs)}) and targets ({len(targets)}) differ in length")
        self.inputs = inputs
        self.targets = targets
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def get_batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.inputs[indices]
        if self.transform is not None:
            x = self.transform(x, indices, epoch)
        return x, self.targets[indices]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]

    def subset(self, indices: torch.Tensor, transform: BatchTransform | None | str = "same") -> "TensorData":
        """A new TensorData holding the given examples (used to split train/test)."""
        return TensorData(
            self.inputs[indices], self.targets[indices], self.transform if transform == "same" else transform
        )


_MASK64 = (1 << 64) - 1


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic), a well-mixed integer hash."""
    def c(v: int) -> int:  # reinterpret an unsigned 64-bit constant as signed int64
        return v - (1 << 64) if v >= 1 << 63 else v

    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * c(0xBF58476D1CE4E5B9)
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * c(0x94D049BB133111EB)
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x


def example_uniform(seed: int, epoch: int, indices: torch.Tensor, stream: int, count: int = 1) -> torch.Tensor:
    """Uniform [0, 1) numbers, shape ``(len(indices), count)``, fixed by (seed, epoch, index, stream).

    The same example in the same epoch gets the same numbers whichever worker or batch loads it.
    ``stream`` separates independent uses (e.g. crop offset vs flip).
    """
    base = (seed * 0x9E3779B1 + epoch * 0x85EBCA77 + stream * 0xC2B2AE3D) & _MASK64
    base = base - (1 << 64) if base >= 1 << 63 else base
    idx = indices.to(torch.int64).unsqueeze(1) * count + torch.arange(count, dtype=torch.int64)
    bits = _mix64(_mix64(idx + base))
    # top 24 bits -> exactly representable float32 in [0, 1)
    return ((bits >> 40) & ((1 << 24) - 1)).to(torch.float32) / float(1 << 24)


DatasetFactory = Callable[..., "DataBundle | tuple[Dataset, Dataset]"]
