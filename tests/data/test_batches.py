from dataclasses import replace

import pytest
import torch

from polytrain.data.base import TensorData
from polytrain.data.batches import BatchPlan, Resumed, Slice, SlicedBatches, eval_batches


def test_each_example_once_per_epoch_and_epochs_differ():
    plan = BatchPlan(num_examples=100, global_batch=10, seed=3)
    epoch0 = torch.cat([plan.global_indices(s) for s in range(10)])
    epoch1 = torch.cat([plan.global_indices(s) for s in range(10, 20)])
    assert sorted(epoch0.tolist()) == list(range(100)) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)


def test_ragged_tail_is_dropped():
    plan = BatchPlan(num_examples=105, global_batch=10)
    assert plan.steps_per_epoch == 10 and plan.position(10) == (1, 0)


def test_shards_tile_the_global_batch():
    plan = BatchPlan(64, 16, seed=1)
    for step in range(4):
        parts = [Slice(i, 4).take(plan.global_indices(step)) for i in range(4)]
        assert torch.equal(torch.cat(parts), plan.global_indices(step))


def test_ragged_eval_shards_cover_everything_once():
    items = torch.arange(11)
    parts = [Slice(i, 3).take_ragged(items) for i in range(3)]
    assert torch.equal(torch.cat(parts), items) and [len(p) for p in parts] == [3, 4, 4]


def test_bad_plans_are_rejected():
    with pytest.raises(ValueError, match="larger than the dataset"):
        BatchPlan(10, 11)
    with pytest.raises(ValueError, match="does not split evenly"):
        Slice(0, 3).take(torch.arange(10))


class _MapStyle(torch.utils.data.Dataset):
    def __init__(self, n):
        self.x = torch.arange(n, dtype=torch.float32).unsqueeze(1)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(i)


def test_fast_path_and_dataloader_path_agree_and_resume():
    n = 40
    plan, shard = BatchPlan(n, 8, seed=5), Slice(1, 2)
    tensor_data = TensorData(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))
    fast = SlicedBatches(tensor_data, plan, shard, torch.device("cpu"))
    slow = SlicedBatches(_MapStyle(n), plan, shard, torch.device("cpu"))
    first = [(s, y) for (s, _, y), _ in zip(fast, range(12))]  # crosses an epoch boundary (5 steps/epoch)
    second = [(s, y) for (s, _, y), _ in zip(slow, range(12))]
    assert [s for s, _ in first] == list(range(12))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, second))
    resumed = SlicedBatches(tensor_data, plan, shard, torch.device("cpu"), start_step=7)
    s, _, y = next(iter(resumed))
    assert s == 7 and torch.equal(y, first[7][1])


def test_eval_batches_cover_the_shard():
    data = TensorData(torch.randn(10, 2), torch.arange(10))
    seen = [y for _, y in eval_batches(data, 3, Slice(0, 2), torch.device("cpu"))]
    assert torch.equal(torch.cat(seen), torch.arange(5))


def test_uneven_slices_tile_the_global_batch():
    plan = BatchPlan(64, 16, seed=1)
    sizes = (7, 2, 5, 2)
    parts = [Slice(i, 4, sizes).take(plan.global_indices(0)) for i in range(4)]
    assert [len(p) for p in parts] == list(sizes)
    assert torch.equal(torch.cat(parts), plan.global_indices(0))
    with pytest.raises(ValueError, match=r"slices \(7, 2, 5, 1\) do not add up to the batch of 16"):
        Slice(0, 4, (7, 2, 5, 1)).take(plan.global_indices(0))
    with pytest.raises(ValueError, match="must be 4 numbers >= 1"):
        Slice(0, 4, (8, 8, 0, 0))


def test_a_per_step_shard_is_asked_when_each_batch_is_drawn():
    n = 40
    plan = BatchPlan(n, 8, seed=5)
    data = TensorData(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))
    asked = []

    def slice_at(step):
        asked.append(step)
        return Slice(0, 2, (2 + step, 6 - step))

    for source in (data, _MapStyle(n)):
        asked.clear()
        batches = iter(SlicedBatches(source, plan, slice_at, torch.device("cpu"), start_step=1))
        for step in (1, 2, 3):
            got_step, _, y = next(batches)
            assert got_step == step and asked[-1] == step  # drawn lazily: one step at a time
            assert torch.equal(y, plan.global_indices(step)[: 2 + step])
    with pytest.raises(ValueError, match="num_workers=0"):
        SlicedBatches(_MapStyle(n), plan, slice_at, torch.device("cpu"), num_workers=2)


def test_batches_carry_the_indices_they_were_drawn_from_on_every_path():
    # labels are the indices here, so what a batch holds says which examples it is; a resumed plan
    # (another global batch from step 3) crossing an epoch, through the loader with a process ahead of it
    n = 40
    plan = replace(BatchPlan(n, 4, seed=5), resumed=Resumed(3, 0, 16, 40))
    data = TensorData(torch.arange(n, dtype=torch.float32).unsqueeze(1), torch.arange(n))
    for source, workers in ((data, 0), (_MapStyle(n), 0), (_MapStyle(n), 1)):
        batches = SlicedBatches(source, plan, Slice(1, 2), torch.device("cpu"), start_step=3, num_workers=workers)
        drawn = [batch for batch, _ in zip(batches, range(9))]  # 6 steps finish epoch 0, 3 begin epoch 1
        assert [b.step for b in drawn] == list(range(3, 12))
        assert all(torch.equal(b.indices, b.targets) for b in drawn)
        assert torch.equal(torch.cat([b.indices for b in drawn[:6]]),
                           torch.cat([Slice(1, 2).take(plan.order(0)[i:i + 4]) for i in range(16, 40, 4)]))
