"""A plan that takes over a saved run's epoch at another global batch (no process): the examples it consumes
are the ones the saved run's plan would have consumed, in the same order; resumes chain; --epochs ends
where it should; positions that do not fit the data are one error."""

import pytest
import torch

from polytrain.data.batches import BatchPlan
from polytrain.errors import ConfigError
from polytrain.train import reshard
from polytrain.train.reshard import DataPosition

N = 203  # not a multiple of any batch used: every epoch drops a ragged tail


def _consumed(plan, start, stop):
    """(epoch, ids) of steps start..stop-1, ids concatenated per epoch."""
    out = {}
    for step in range(start, stop):
        out.setdefault(plan.position(step)[0], []).extend(plan.global_indices(step).tolist())
    return out


def _resume(plan, step, new_batch):
    """What a run resumed from ``plan``'s checkpoint at ``step`` with ``new_batch`` draws: through the
    checkpoint's saved position, as the session does."""
    saved = {"data_position": DataPosition.at(plan, step).as_dict()}
    position = DataPosition.saved(saved, plan.num_examples)
    return reshard.continue_plan(BatchPlan(N, new_batch, seed=plan.seed), position, step)


@pytest.mark.parametrize("old, new, at", [(24, 12, 3), (12, 24, 5), (12, 24, 4), (20, 30, 2), (24, 24, 3)])
def test_the_rest_of_the_epoch_is_the_saved_runs_rest_in_its_order(old, new, at):
    straight = BatchPlan(N, old, seed=4)
    resumed = _resume(straight, at, new)
    end = straight.steps_per_epoch
    theirs = _consumed(straight, at, end)[0]
    ours = _consumed(resumed, at, resumed.epoch_start(1))[0] if resumed.epoch_start(1) > at else []
    skipped = reshard.skipped_examples(resumed)
    assert skipped == len(theirs) % new
    assert ours == theirs[: len(theirs) - skipped]  # the same permutation, cut into the new batch size
    # the next epoch is the new batch size's own: the same permutation, its own ragged tail
    first = resumed.epoch_start(1)
    nxt = _consumed(resumed, first, first + resumed.steps_per_epoch)
    assert list(nxt) == [1] and nxt[1] == straight.order(1)[: N // new * new].tolist()


def test_the_same_batch_at_a_batch_boundary_keeps_the_plan_itself():
    plan = BatchPlan(N, 16, seed=4)
    assert _resume(plan, 20, 16) == plan and _resume(plan, 20, 16).resumed is None


def test_resumes_chain_and_keep_the_first_runs_epoch_end():
    first = BatchPlan(N, 24, seed=4)  # epoch 0 ends at example 192
    second = _resume(first, 2, 12)  # from example 48, steps of 12
    third = _resume(second, 5, 36)  # from example 48 + 3 * 12 = 84: 108 left, three steps of 36
    assert third.resumed.offset == 84 and third.resumed.end == 192 and third.resumed_steps == 3
    ids = [*_consumed(first, 0, 2)[0], *_consumed(second, 2, 5)[0], *_consumed(third, 5, third.epoch_start(1))[0]]
    assert ids == _consumed(first, 0, first.steps_per_epoch)[0]
    assert len(set(ids)) == len(ids) == 192


def test_epochs_end_at_the_end_of_the_last_epoch_steps_stay_steps():
    resumed = _resume(BatchPlan(N, 24, seed=4), 3, 12)  # epoch 0: 120 examples left -> 10 steps; then 16 an epoch
    assert resumed.epoch_start(1) == 13 and resumed.epoch_start(3) == 13 + 2 * 16
    assert reshard.total_steps(resumed, None, 3) == 45 and reshard.total_steps(resumed, 30, None) == 30
    assert resumed.position(13) == (1, 0) and resumed.epochs_done(7) == pytest.approx((72 + 4 * 12) / 192)
    with pytest.raises(ValueError, match="comes before this plan's first step"):
        resumed.global_indices(2)


def test_a_checkpoint_without_positions_in_examples_resumes_from_its_batch():
    old = {"data_position": {"epoch": 1, "batch": 3, "global_batch": 16}}  # before "examples" were saved
    assert DataPosition.saved(old, N) == DataPosition(1, 48, 192, 16)
    plain = BatchPlan(N, 16, seed=4)  # 12 steps an epoch: the checkpoint was made at step 15
    assert reshard.continue_plan(plain, DataPosition.saved(old, N), 15) is plain  # at its batch: the plan itself
    halved = reshard.continue_plan(BatchPlan(N, 8, seed=4), DataPosition.saved(old, N), 15)
    assert torch.equal(halved.global_indices(15), plain.global_indices(15)[:8])  # at another: from example 48


def test_a_position_that_does_not_fit_the_data_is_one_error():
    saved = {"data_position": {"epoch": 0, "batch": 9, "examples": 180, "epoch_examples": 192, "global_batch": 20}}
    with pytest.raises(ConfigError, match=r"^--resume: the checkpoint stopped at example 180 of epoch 0's 192, "
                                          r"which does not fit this training set of 150 examples: it was made on "
                                          r"other data; .*another --checkpoint-dir$"):
        DataPosition.saved(saved, 150)


def test_the_lr_moves_from_the_saved_runs_to_the_new_one():
    from polytrain.train.lr_schedules import parse_lr_schedule

    target = parse_lr_schedule("cosine", 0.2, 100)
    ramp = reshard.Rescaled(target, 40, 0.05, 3)
    assert [ramp(s) for s in (40, 41, 42)] == pytest.approx(
        [0.05 + (target(s) - 0.05) * k / 4 for s, k in ((40, 1), (41, 2), (42, 3))])
    assert ramp(43) == target(43) and ramp(99) == target(99) and str(ramp) == "cosine:min_lr=0.0"
    assert reshard.saved_lr({"lr": 0.3}) == 0.3
    assert reshard.saved_lr({"optimizer": {"param_groups": [{"lr": 0.1}]}}) == 0.1  # older checkpoints


def test_resumed_plans_index_like_torch_randperm():
    # independent of the plan's code: epoch 0's order is torch's permutation for the plan's seed
    plan = _resume(BatchPlan(N, 24, seed=0), 1, 8)
    expected = torch.randperm(N, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.cat([plan.global_indices(s) for s in range(1, plan.epoch_start(1))]), expected[24:192])
