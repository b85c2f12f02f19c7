import pytest
import torch

import polytrain
from polytrain.data.batches import BatchPlan, Slice, SlicedBatches
from polytrain.data.buckets import BucketedBatchPlan, batch_plan
from polytrain.data.sentences import Sentences
from polytrain.data.text import TokenWindows

GEN = torch.Generator().manual_seed(0)
DATA = Sentences([b"w" * int(n) for n in torch.randint(1, 60, (203,), generator=GEN)])


def _padded_tokens(plan, steps):
    return sum(len(idx) * int(DATA.lengths[idx].max()) for idx in map(plan.global_indices, range(steps)))


def test_every_example_once_per_epoch_with_less_padding():
    plan = batch_plan(DATA, 10, seed=1, bucket_window=5)
    assert isinstance(plan, BucketedBatchPlan) and plan.steps_per_epoch == 20
    for epoch in range(2):
        seen = torch.cat([plan.global_indices(epoch * 20 + b) for b in range(20)])
        assert len(seen) == 200 and len(set(seen.tolist())) == 200
    plain = BatchPlan(len(DATA), 10, seed=1)
    assert _padded_tokens(plan, 20) < 0.8 * _padded_tokens(plain, 20)
    assert not torch.equal(plan.global_indices(0), plan.global_indices(20))  # epochs differ


def test_the_order_is_a_function_of_the_seed_alone():
    a, b = (batch_plan(DATA, 10, seed=3, bucket_window=4) for _ in range(2))
    assert all(torch.equal(a.global_indices(s), b.global_indices(s)) for s in range(45))
    other = batch_plan(DATA, 10, seed=4, bucket_window=4)
    assert not all(torch.equal(a.global_indices(s), other.global_indices(s)) for s in range(20))


def test_resumed_sharded_batches_equal_the_uninterrupted_ones():
    plan = batch_plan(DATA, 8, seed=2, bucket_window=3)

    def take(shard, start, count):
        it = iter(SlicedBatches(DATA, plan, shard, torch.device("cpu"), start_step=start))
        return [next(it) for _ in range(count)]

    for shard in (Slice(0, 2), Slice(1, 2)):
        whole, resumed = take(shard, 0, 30), take(shard, 23, 7)
        assert all(torch.equal(w.targets, r.targets) for w, r in zip(whole[23:], resumed))


def test_fixed_windows_and_no_window_keep_the_plain_plan():
    windows = TokenWindows(torch.zeros(100, dtype=torch.uint8), seq_len=9, stride=9)
    assert type(batch_plan(windows, 4)) is BatchPlan
    assert type(batch_plan(DATA, 4, bucket_window=None)) is BatchPlan
    with pytest.raises(ValueError, match="lengths of all 5 examples"):
        BucketedBatchPlan(5, 2, lengths=torch.ones(4))


def _bucketed_run(tmp_path, strategy, workers, **more):
    corpus = tmp_path / "sentences.txt"
    if not corpus.exists():
        gen = torch.Generator().manual_seed(5)
        corpus.write_text("".join("word " * int(n) + "end.\n" for n in torch.randint(1, 12, (240,), generator=gen)))
    settings = dict(strategy=strategy, workers=workers, data=f"sentences:{corpus},bucket_window=4",
                    model="rnn_lm:hidden=32", steps=12, batch_size=16, lr=0.1, seed=2, eval_every=0,
                    progress="off", log_every=2)
    return polytrain.fit(**{**settings, **more})


def test_a_run_on_bucketed_sentences_trains_alike_on_one_worker_and_two(tmp_path):
    """``sentences:FILE,bucket_window=W``: the plan every rank draws from; sync still equals single."""
    single = _bucketed_run(tmp_path, "single", 1)
    sync = _bucketed_run(tmp_path, "sync", 2)
    assert sync["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    with pytest.raises(polytrain.PolytrainError, match="bucket_window must be a whole number"):
        polytrain.fit(data=f"sentences:{tmp_path / 'sentences.txt'},bucket_window=0", steps=1)


def test_a_bucketed_run_resumes_at_its_own_batch_only(tmp_path):
    ckpt = str(tmp_path / "ck")
    _bucketed_run(tmp_path, "single", 1, checkpoint_dir=ckpt)
    resumed = _bucketed_run(tmp_path, "single", 1, checkpoint_dir=ckpt, resume=True, steps=14)
    assert resumed["steps"] == 14
    with pytest.raises(polytrain.PolytrainError, match="made with global batch 16: a bucketed plan continues only"):
        _bucketed_run(tmp_path, "single", 1, checkpoint_dir=ckpt, resume=True, steps=20, batch_size=8)
