"""The balanced split is plain arithmetic: the same measurements give every rank the same slices."""

import pytest
import torch
from torch import nn

from polytrain.strategies.balance import (
    Balancer,
    BalancePolicy,
    equal_split,
    proportional_split,
)
from polytrain.strategies.step import loss_divisor


def _measured(seconds_per_example, sizes):
    return [(t * n, n) for t, n in zip(seconds_per_example, sizes)]


def test_equal_speeds_keep_equal_slices():
    balancer = Balancer(128, 2)
    assert balancer.sizes == (64, 64)
    for _ in range(5):
        assert balancer.update(_measured([1e-3, 1e-3], balancer.sizes)) == (64, 64)
    assert balancer.changes == 0


def test_a_worker_half_as_fast_gets_a_third_of_the_batch():
    balancer = Balancer(128, 2, BalancePolicy(smoothing=1.0))
    sizes = balancer.update(_measured([1e-3, 2e-3], balancer.sizes))
    assert sizes == (85, 43) and sum(sizes) == 128
    assert balancer.predicted_step(sizes) < balancer.predicted_step((64, 64)) * 0.9
    # and when the slow worker recovers, the slices go back
    for _ in range(6):
        sizes = balancer.update(_measured([1e-3, 1e-3], sizes))
    assert sizes == (64, 64)


def test_slices_stay_within_the_shift_bound_and_multiples():
    balancer = Balancer(96, 3, BalancePolicy(smoothing=1.0, max_shift=0.5, multiple=4))
    sizes = balancer.update(_measured([1e-3, 1e-3, 50e-3], balancer.sizes))  # one worker 50x slower
    assert sum(sizes) == 96 and all(n % 4 == 0 for n in sizes)
    assert sizes[2] == 16  # the floor: half the equal slice of 32, a multiple of 4
    assert sizes[0] == sizes[1] == 40


def test_small_differences_do_not_reshape_the_batch():
    balancer = Balancer(128, 2, BalancePolicy(smoothing=1.0, min_gain=0.01))
    assert balancer.update(_measured([1e-3, 1.005e-3], balancer.sizes)) == (64, 64)  # 0.5 % slower: no change
    assert balancer.update(_measured([1e-3, 1.1e-3], balancer.sizes)) != (64, 64)


def test_smoothing_weighs_the_newest_measurement():
    balancer = Balancer(100, 2, BalancePolicy(smoothing=0.5))
    balancer.update(_measured([1.0, 1.0], balancer.sizes))
    balancer.update(_measured([1.0, 3.0], balancer.sizes))
    assert balancer.per_example == [1.0, 2.0]


def test_ranks_that_disagree_about_the_split_are_an_error():
    balancer = Balancer(128, 2)
    with pytest.raises(ValueError, match=r"slices \[64, 60\] do not add up to the global batch 128"):
        balancer.update([(0.1, 64), (0.1, 60)])
    with pytest.raises(ValueError, match="expected 2 measurements"):
        balancer.update([(0.1, 128)])


def test_proportional_split_hands_out_remainders_fairly():
    assert proportional_split(10, [1, 1, 1], 1, 10) == (4, 3, 3)
    assert proportional_split(16, [3, 1], 1, 16, multiple=2) == (12, 4)
    assert proportional_split(12, [3, 1], 4, 12, multiple=2) == (8, 4)  # the floor of 4 holds
    with pytest.raises(ValueError, match="cannot split 10 into 2 multiples of 4"):
        proportional_split(10, [1, 1], 1, 10, multiple=4)
    assert equal_split(12, 3) == (4, 4, 4)
    with pytest.raises(ValueError, match="do not split equally"):
        equal_split(10, 3)


def test_weighted_slices_give_the_gradient_of_the_whole_batch():
    """What each rank computes with loss_divisor, averaged like DDP does, is the full-batch gradient."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(5, 3), torch.randn(24, 5), torch.randint(0, 3, (24,))
    loss_fn = nn.CrossEntropyLoss()

    def grad(loss):
        model.zero_grad()
        loss.backward()
        return model.weight.grad.clone()

    whole = grad(loss_fn(model(x), y))
    workers, sizes = 3, (13, 4, 7)
    starts = [0, 13, 17]
    per_rank = [grad(loss_fn(model(x[s:s + n]), y[s:s + n]) / loss_divisor(24, workers, n)) for s, n in zip(starts, sizes)]
    averaged = sum(per_rank) / workers
    torch.testing.assert_close(averaged, whole, rtol=1e-6, atol=1e-7)
    assert loss_divisor(2 * 64, 2, 16) == 4.0  # equal slices, 4 micro-batches: exactly the old division by K
