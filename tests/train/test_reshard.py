"""Resuming ``sync`` at another world size on real gloo processes: 4 workers stop at step 3, 2 workers
resume (each keeps 64 examples, so the global batch halves) and stop at step 5, 4 workers resume that.
At each resume the strategy holds the checkpoint's model and optimizer state bit for bit; the examples
consumed after it are the uninterrupted run's (the same order within the epoch in progress; the next
epochs the new batch's own cut of the same permutation); the LR moves to the new batch's over the warm-up;
the loss stays finite and falls."""

import math
import shutil

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.train import example_ids
from tests.helpers.resume import assert_same_state, resume_and_read_back
from tests.helpers.spawn import spawn

# digits: 1,437 training examples; 4 x 64 = 256 a step: 5 steps (1,280 examples) an epoch, 2 x 64: 11
RUN = dict(data="digits", model="mlp:hidden=32", worker_batch_size=64, epochs=2, strategy="sync", optimizer="sgd",
           lr=0.1, momentum=0.9, lr_scaling="linear", base_batch_size=256, rescale_warmup_steps=3,
           progress="off", log_every=1, eval_every=0, seed=3, timeout=60, keep_checkpoints=10)


def _copy_checkpoint(source, step, target):
    target.mkdir()
    for suffix in (".pt", ".json"):
        shutil.copy(source / f"step-{step:08d}{suffix}", target)


def _resume(root, name, workers, source, step, **settings):
    _copy_checkpoint(source, step, root / name)
    config = make_config(**{**RUN, **settings}, workers=workers, checkpoint_dir=str(root / name), resume=True,
                         log_example_ids=str(root / f"{name}.ids"), metrics_file=str(root / f"{name}.jsonl"))
    (held, summary), *_ = spawn(resume_and_read_back, workers, config, timeout=60)
    return held, summary


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    polytrain.fit(**RUN, workers=4, checkpoint_dir=str(root / "a"), checkpoint_every=3,
                  log_example_ids=str(root / "a.ids"), metrics_file=str(root / "a.jsonl"))
    b = _resume(root, "b", 2, root / "a", 3, checkpoint_every=5)
    c = _resume(root, "c", 4, root / "b", 5)
    return root, b, c


def _ids(root, name):
    return example_ids.read(root / f"{name}.ids")


def _flat(records, steps):
    return [i for step in steps for i in records[step]["ids"]]


def _steps(root, name):
    import json
    return {r["step"]: r for r in map(json.loads, open(root / f"{name}.jsonl")) if r["event"] == "step"}


def _saved(directory, step):
    return torch.load(directory / f"step-{step:08d}.pt", weights_only=True)


def test_4_to_2_workers(runs):
    root, (held, summary), _ = runs
    assert_same_state(held, _saved(root / "a", 3))
    a, b = _ids(root, "a"), _ids(root, "b")
    assert sorted(a) == list(range(1, 11)) and sorted(b) == list(range(4, 19))  # A: 2 x 5 steps; B: 3 + 4 + 11
    assert summary["global_batch"] == 128 and summary["steps"] == 18
    # the rest of epoch 0: A's steps 4-5 (2 x 256), in order, as B's steps 4-7 (4 x 128)
    assert [b[s]["epoch"] for s in range(4, 8)] == [0] * 4 and _flat(b, range(4, 8)) == _flat(a, [4, 5])
    # epoch 1: the same permutation; A cuts it at 5 x 256 = 1280, B at 11 x 128 = 1408 (its own ragged tail)
    epoch1 = _flat(b, range(8, 19))
    assert epoch1[:1280] == _flat(a, range(6, 11)) and len(set(epoch1)) == 1408
    assert set(_flat(a, range(1, 4)) + _flat(b, range(4, 8))) == set(_flat(a, range(1, 6)))  # epoch 0, once each
    records = _steps(root, "b")
    # LR: A ran 0.1 (tuned for 256); for 128, --lr-scaling linear gives 0.05, reached over 3 steps
    assert [records[s]["lr"] for s in (4, 5, 6, 7)] == pytest.approx([0.1 - 0.05 * k / 4 for k in (1, 2, 3)] + [0.05])
    losses = [records[s]["loss"] for s in range(4, 19)]
    assert all(math.isfinite(x) for x in losses) and sum(losses[-3:]) < sum(losses[:3])


def test_2_to_4_workers(runs):
    root, _, (held, summary) = runs
    assert_same_state(held, _saved(root / "b", 5))
    a, b, c = _ids(root, "a"), _ids(root, "b"), _ids(root, "c")
    assert sorted(c) == list(range(6, 12)) and summary["global_batch"] == 256
    # epoch 0's last 256 examples: B's steps 6-7, A's step 5, C's step 6
    assert _flat(c, [6]) == _flat(b, [6, 7]) == _flat(a, [5])
    # epoch 1 at 256 again: exactly the uninterrupted run's, step for step
    assert [c[s]["ids"] for s in range(7, 12)] == [a[s]["ids"] for s in range(6, 11)]
    records = _steps(root, "c")
    # B saved mid warm-up: its next LR was 0.1 - 0.05 * 3 / 4; from there to 0.1 for 256 over 3 steps
    assert records[6]["lr"] == pytest.approx(0.0625 + 0.0375 / 4) and records[9]["lr"] == pytest.approx(0.1)
    assert all(math.isfinite(records[s]["loss"]) for s in range(6, 12))
