"""Batches of sentences of similar length, so that padding to each batch's longest wastes little.

:class:`BucketedBatchPlan` is a :class:`BatchPlan` whose epoch order is cut into windows of ``window``
global batches; inside a window the examples are sorted by length (stable), cut into global batches, and
those batches are visited in a shuffled order. Every example is still seen once per epoch, and a step's
examples are a pure function of (seed, epoch, step): any worker, any resumed run, draws the same batch.
The longest sentences of a window land in one batch, so the workers' slices of that batch hold different
numbers of tokens; the loss is weighted by them (``count_units``), not by examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from polytrain.data.batches import _EPOCH_STRIDE, BatchPlan, _epoch_order

_WINDOW_STREAM = 0x5EED  # separates the batch-order shuffle from the epoch permutation of the same seed


@dataclass(frozen=True)
class BucketedBatchPlan(BatchPlan):
    lengths: torch.Tensor = field(default=None, compare=False, repr=False)  # type: ignore[assignment]
    window: int = 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lengths is None or len(self.lengths) != self.num_examples:
            raise ValueError(f"a bucketed plan needs the lengths of all {self.num_examples} examples")
        if self.window < 1:
            raise ValueError(f"the bucket window must be >= 1 global batches, got {self.window}")
        if self.resumed is not None:  # its windows are cut in whole batches from each epoch's start
            raise ValueError("a bucketed plan continues only at the global batch it started with")

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, batch = self.position(step)
        first = batch - batch % self.window
        count = min(self.window, self.steps_per_epoch - first)
        order = _epoch_order(self.num_examples, self.seed, epoch, self.shuffle)
        chunk = order[first * self.global_batch : (first + count) * self.global_batch]
        chunk = chunk[torch.argsort(self.lengths[chunk], stable=True)]
        gen = torch.Generator().manual_seed((self.seed * _EPOCH_STRIDE + epoch) * 65_537 + first + _WINDOW_STREAM)
        visit = torch.randperm(count, generator=gen) if self.shuffle else torch.arange(count)
        start = int(visit[batch - first]) * self.global_batch
        return chunk[start : start + self.global_batch].clone()


def batch_plan(dataset: Dataset, global_batch: int, seed: int = 0, bucket_window: int | None = 20) -> BatchPlan:
    """The plan for ``dataset``: bucketed by length when it has ``lengths`` (sentences) and ``bucket_window``
    is set, the plain shuffled plan otherwise."""
    lengths = getattr(dataset, "lengths", None)
    if lengths is None or not bucket_window:
        return BatchPlan(len(dataset), global_batch, seed)
    return BucketedBatchPlan(len(dataset), global_batch, seed, lengths=lengths, window=bucket_window)
