"""Global batches and each worker's slice of them.

A :class:`BatchPlan` fixes, for every (epoch, batch), which examples form the *global* batch: a seeded
permutation per epoch, cut into ``global_batch`` pieces (the ragged tail is dropped so every step sees the
same number of examples). A :class:`Slice` then takes worker ``index``'s contiguous slice. The union of all
slices is exactly the global batch, each example once per epoch, so N workers on slices compute the same
averaged gradient as one device on the whole batch. Both are plain data: printable and testable alone.

A run resumed with another global batch continues the epoch it stopped in from the example it reached
(:class:`Resumed`): the same permutation, cut into the new batch size, up to where the saved run would have
ended that epoch; the epochs after it are the new batch size's own.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, Sampler


_EPOCH_STRIDE = 1_000_003  # keeps the per-epoch permutation seeds of nearby run seeds apart


@dataclass
class Batch:
    """This rank's part of global step ``step``; unpacks as ``(step, inputs, targets)``."""

    step: int
    inputs: torch.Tensor
    targets: torch.Tensor
    #: the task's units (examples; real tokens for ``lm``) in the whole global batch, over every slice
    global_units: int
    #: the examples in the whole global batch (None: not told, the slices are equal)
    global_examples: int | None = None
    #: the dataset indices of this rank's examples (what ``--log-example-ids`` records)
    indices: torch.Tensor | None = None
    #: the epoch its examples belong to, where the plan cannot tell from the step (a stream's)
    epoch: int | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.step, self.inputs, self.targets))

    def __len__(self) -> int:
        return self.inputs.shape[0]  # (not len(): a Python-level call of torch's, every step)


@dataclass(frozen=True)
class Resumed:
    """Where a plan takes over a saved run's epoch: global step ``step`` is epoch ``epoch``'s example
    ``offset`` (of its permutation), and that epoch stops at example ``end`` (the saved run's end of it)."""

    step: int
    epoch: int
    offset: int
    end: int


@dataclass(frozen=True)
class BatchPlan:
    num_examples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    #: None: step 0 starts epoch 0; else the epoch in progress at a resume with another global batch
    resumed: Resumed | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.global_batch > self.num_examples:
            raise ValueError(
                f"the global batch ({self.global_batch}) is larger than the dataset ({self.num_examples} examples)"
            )
        r = self.resumed
        if r is not None and not (0 <= r.offset <= r.end <= self.num_examples and r.step >= 0 and r.epoch >= 0):
            raise ValueError(f"resumed position {r} does not fit {self.num_examples} examples")

    @property
    def steps_per_epoch(self) -> int:
        """Steps of a whole epoch (the resumed one, if any, may have fewer)."""
        return self.num_examples // self.global_batch

    @property
    def resumed_steps(self) -> int:
        """Steps left in the resumed epoch: whole batches between its offset and its end."""
        r = self.resumed
        return 0 if r is None else (r.end - r.offset) // self.global_batch

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within epoch) of a global step; in a resumed epoch, the batch counts from the resume."""
        if self.resumed is None:
            return divmod(step, self.steps_per_epoch)
        r, later = self.resumed, self._after_resumed(step)
        if later < 0:
            return r.epoch, step - r.step
        epoch, batch = divmod(later, self.steps_per_epoch)
        return r.epoch + 1 + epoch, batch

    def locate(self, step: int) -> tuple[int, int, int]:
        """(epoch, place of the step's first example in that epoch's order, where the plan stops that epoch)."""
        epoch, batch = self.position(step)
        r = self.resumed
        if r is not None and epoch == r.epoch:
            return epoch, r.offset + batch * self.global_batch, r.end
        return epoch, batch * self.global_batch, self.steps_per_epoch * self.global_batch

    def epoch_start(self, epoch: int) -> int:
        """The global step that begins ``epoch`` (for ``--epochs E``: the run ends at ``epoch_start(E)``)."""
        r = self.resumed
        if r is None:
            return epoch * self.steps_per_epoch
        if epoch <= r.epoch:
            return r.step
        return r.step + self.resumed_steps + (epoch - r.epoch - 1) * self.steps_per_epoch

    def epochs_done(self, step: int) -> float:
        """Epochs completed before global step ``step``, fractional (for progress records)."""
        epoch, start, end = self.locate(step)
        return epoch + start / end if end else float(epoch)

    def order(self, epoch: int) -> torch.Tensor:
        return _epoch_order(self.num_examples, self.seed, epoch, self.shuffle).clone()

    def global_indices(self, step: int) -> torch.Tensor:
        epoch, start, _ = self.locate(step)
        order = _epoch_order(self.num_examples, self.seed, epoch, self.shuffle)
        return order[start : start + self.global_batch].clone()

    def _after_resumed(self, step: int) -> int:
        """Steps after the resumed epoch's last (negative: inside it); steps before the resume have no batch."""
        r = self.resumed
        assert r is not None
        if step < r.step:
            raise ValueError(f"step {step} comes before this plan's first step ({r.step}, a resume)")
        return step - r.step - self.resumed_steps


@functools.lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> torch.Tensor:
    """The example order of one epoch, computed once per epoch rather than once per step (a permutation
    of a million examples takes tens of milliseconds). Callers get copies, never this tensor."""
    if not shuffle:
        return torch.arange(num_examples)
    gen = torch.Generator().manual_seed(seed * _EPOCH_STRIDE + epoch)
    return torch.randperm(num_examples, generator=gen)


@dataclass(frozen=True)
class Slice:
    """Worker ``index`` of ``count`` data-parallel workers takes the index-th slice of a batch: an equal one,
    or ``sizes[index]`` examples after the slices of the workers before it (a balanced, uneven split)."""

    index: int = 0
    count: int = 1
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"slice index {self.index} is outside 0..{self.count - 1}")
        if self.sizes is not None and (len(self.sizes) != self.count or min(self.sizes) < 1):
            raise ValueError(f"slice sizes {self.sizes} must be {self.count} numbers >= 1")

    def take(self, items: torch.Tensor) -> torch.Tensor:
        if self.sizes is not None:
            if sum(self.sizes) != len(items):
                raise ValueError(f"slices {self.sizes} do not add up to the batch of {len(items)}")
            start = sum(self.sizes[: self.index])
            return items[start : start + self.sizes[self.index]]
        if self.count == 1:
            return items
        count = items.shape[0]
        if count % self.count:
            raise ValueError(f"a batch of {count} does not split evenly over {self.count} workers")
        size = count // self.count
        return items[self.index * size : (self.index + 1) * size]

    def take_ragged(self, items: torch.Tensor) -> torch.Tensor:
        """Near-equal contiguous slices of any length (used for evaluation, where nothing is dropped)."""
        bounds = [len(items) * i // self.count for i in range(self.count + 1)]
        return items[bounds[self.index] : bounds[self.index + 1]]


class _StepSampler(Sampler[list[int]]):
    """Yields this slice's index lists for steps ``start .. stop-1`` of one epoch (DataLoader path), and
    queues each in ``drawn``: the loader runs the sampler ahead of the batches it returns, in order."""

    def __init__(self, plan: BatchPlan, slice_at: Callable[[int], Slice], start: int, stop: int):
        self.plan, self.slice_at, self.start, self.stop = plan, slice_at, start, stop
        self.drawn: collections.deque[list[int]] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            indices = self.slice_at(step).take(self.plan.global_indices(step)).tolist()
            self.drawn.append(indices)
            yield indices

    def __len__(self) -> int:
        return self.stop - self.start


class SlicedBatches:
    """This worker's batches for global steps ``start_step ..``, as :class:`Batch` objects on ``device``
    (they unpack as ``(step, x, y)``).

    In-memory datasets with ``get_batch`` are indexed in one op; other map-style datasets go through a
    ``DataLoader`` (``num_workers`` loader processes) fed by the same plan. ``slice`` is this worker's
    slice, or a function giving it for each step (a balanced split that changes as the run goes); such a
    function is called when that step's batch is drawn, which loader processes would do steps ahead.
    """

    def __init__(self, dataset: Dataset, plan: BatchPlan, slice: Slice | Callable[[int], Slice],
                 device: torch.device, start_step: int = 0, num_workers: int = 0):
        if callable(slice) and num_workers:
            raise ValueError("a per-step slice needs batches drawn in this process (num_workers=0)")
        self.slice_at = slice if callable(slice) else (lambda step: slice)
        self.dataset, self.plan, self.device = dataset, plan, device
        self.start_step, self.num_workers = start_step, num_workers
        # looked up once: a batch of a tiny model takes tens of microseconds, where every lookup shows
        self._get_batch = getattr(dataset, "get_batch", None)
        self._count_units = getattr(dataset, "count_units", None)

    def __iter__(self) -> Iterator[Batch]:
        if hasattr(self.dataset, "get_batch"):
            yield from self._direct()
        else:
            yield from self._loader()

    def _direct(self) -> Iterator[Batch]:
        step = self.start_step
        while True:
            yield self.at(step)
            step += 1

    def at(self, step: int) -> Batch:
        """This worker's batch of any global ``step``, drawn in this process (for a strategy whose workers
        take steps out of order: a slice of an earlier step handed back by a lost worker)."""
        everyone = self.plan.global_indices(step)
        mine = self.slice_at(step).take(everyone)
        get_batch = self._get_batch
        if get_batch is not None:
            x, y = get_batch(mine, self.plan.position(step)[0])
        else:
            x, y = torch.utils.data.default_collate([self.dataset[int(i)] for i in mine])
        return Batch(step, self._to_device(x), self._to_device(y), self._units(everyone), everyone.shape[0], mine)

    def _loader(self) -> Iterator[Batch]:
        step = self.start_step
        while True:
            epoch_end = self.plan.epoch_start(self.plan.position(step)[0] + 1)
            sampler = _StepSampler(self.plan, self.slice_at, step, epoch_end)
            loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers,
                                pin_memory=self.device.type == "cuda")
            for x, y in loader:
                everyone = self.plan.global_indices(step)
                yield Batch(step, self._to_device(x), self._to_device(y), self._units(everyone), len(everyone),
                            torch.tensor(sampler.drawn.popleft()))
                step += 1

    def _units(self, everyone: torch.Tensor) -> int:
        """The loss units of the whole global batch: what the dataset counts (real tokens), else examples."""
        count = self._count_units
        return int(count(everyone)) if count is not None else everyone.shape[0]

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if t.device != self.device else t


def eval_batches(dataset: Dataset, batch_size: int, slice: Slice, device: torch.device
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's contiguous part of ``dataset``, every example once, in batches of ``batch_size``; then, if
    another worker's part takes more batches, empty batches up to that count: every worker evaluates as many
    batches as every other, so a model whose forward is a collective (a sharded one) never waits alone."""
    mine = slice.take_ragged(torch.arange(len(dataset)))
    longest = -(-len(dataset) // slice.count)  # the largest ragged part, which the first workers take
    count = -(-longest // batch_size)
    for start in range(0, count * batch_size, batch_size):
        indices = mine[start : start + batch_size]
        empty = len(indices) == 0
        if empty:
            indices = torch.arange(1)  # an example's shapes, cut to none below
        if hasattr(dataset, "get_batch"):
            x, y = dataset.get_batch(indices, 0)
        else:
            x, y = torch.utils.data.default_collate([dataset[int(i)] for i in indices])
        if empty:
            x, y = x[:0], y[:0]
        yield x.to(device), y.to(device)
