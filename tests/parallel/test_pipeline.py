"""``pipeline`` and ``hybrid`` on real gloo processes end where ``single`` ends on the same global batches,
for every schedule; checkpoints move between them and ``single``/``sync``; bad settings are one line
before any process starts."""

import json

import pytest
import torch

import polytrain
from polytrain.errors import ConfigError
from polytrain.parallel.pp import plan
from polytrain.train.checkpoint import Checkpointer, load_checkpoint

MODEL = "transformer_lm:layers=4,dim=32,heads=2"  # units: embed, blocks.0-3, head
RUN = dict(model=MODEL, data="text:seq_len=16", batch_size=8, steps=10, optimizer="sgd", lr=0.1, momentum=0.9,
           progress="off", eval_every=5, log_every=5, seed=0, timeout=60)


def _fit(tmp_path, name, **settings):
    path = tmp_path / f"{name}.pt"
    run = {**RUN, **settings}
    summary = polytrain.fit(save_model=str(path), metrics_file=str(tmp_path / f"{name}.jsonl"), **run)
    losses = [r["loss"] for r in map(json.loads, open(tmp_path / f"{name}.jsonl")) if r.get("event") == "step"]
    return summary, torch.load(path, weights_only=True), losses


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    where = tmp_path_factory.mktemp("single")
    checkpoints = str(where / "checkpoints")  # the last one holds single's optimizer state at the end
    return (*_fit(where, "single", strategy="single", checkpoint_dir=checkpoints), checkpoints)


def _cross_rank_hops(ranks, chunks, placement):
    """Per rank, how many stage boundaries it sends an activation over (and so receives its gradient)
    plus how many it receives one over (and sends a gradient back): the boundaries it shares with
    another rank."""
    stages = ranks * chunks
    hops = [0] * ranks
    for s in range(stages - 1):
        a, b = plan.stage_rank(s, ranks, placement), plan.stage_rank(s + 1, ranks, placement)
        if a != b:
            hops[a] += 1
            hops[b] += 1
    return hops


def _same_as_single(single, run):
    reference_summary, reference, reference_losses, _ = single
    summary, weights, losses = run
    assert weights.keys() == reference.keys()  # the whole model, named as unsplit
    for key, value in reference.items():
        assert torch.linalg.vector_norm((weights[key] - value).double()) <= 1e-5 * torch.linalg.vector_norm(
            value.double()) + 1e-7, key
    assert losses == pytest.approx(reference_losses, rel=1e-5)
    assert summary["eval_loss"] == pytest.approx(reference_summary["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("schedule, stages, microbatches", [
    ("gpipe", 2, 2), ("1f1b", 2, 4), ("interleaved-1f1b", 2, 2), ("zero-bubble", 2, 4), ("zbv", 2, 2),
    ("1f1b", 4, 4),  # P=4 once: four processes on two shared cores take ~30 s
])
def test_pipeline_equals_single(tmp_path, single, schedule, stages, microbatches):
    run = _fit(tmp_path, "pipeline", strategy="pipeline", stages=stages, microbatches=microbatches,
               schedule=schedule)
    _same_as_single(single, run)
    summary = run[0]
    assert summary["workers"] == stages and summary["pipeline_schedule"] == schedule
    assert len(summary["rank_pp_busy_s"]) == stages and all(b > 0 for b in summary["rank_pp_busy_s"])
    assert all(0 <= b < 1 for b in summary["rank_pp_bubble"])
    chunks = 1 if schedule in ("gpipe", "1f1b") else 2
    assert summary["pp_bubble_theoretical"] == pytest.approx((stages - 1) / (chunks * microbatches + stages - 1),
                                                             abs=1e-4)
    assert [unit for stage in summary["pipeline_split"] for unit in stage] == \
        ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    # each cross-rank boundary moves every example's (16 x 32) float32 activation one way and its
    # gradient back, every step (the first step's shape exchange and evaluation are not counted)
    info = plan.schedule_info(schedule)
    expected = [h * RUN["steps"] * RUN["batch_size"] * 16 * 32 * 4
                for h in _cross_rank_hops(stages, info.chunks, info.placement)]
    assert summary["rank_bytes_sent"] == expected and summary["rank_bytes_received"] == expected
    # only its own stages stay resident on a rank: together they are the model, once
    total = sum(v.numel() for v in single[1].values() if v.is_floating_point())
    assert sum(summary["rank_pp_parameters"]) == total and max(summary["rank_pp_parameters"]) < total


def test_split_by_name_and_hybrid_dp2_x_pp2_equal_single(tmp_path, single):
    run = _fit(tmp_path, "hybrid", strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2, split_at="blocks.1")
    _same_as_single(single, run)
    assert run[0]["pipeline_split"] == [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]
    assert run[0]["bytes_sent"] > 0  # the stages' gradients averaged over dp


@pytest.mark.parametrize("first, then", [
    (dict(strategy="pipeline", stages=2, microbatches=2, schedule="1f1b"), dict(strategy="single")),
    (dict(strategy="sync", workers=2), dict(strategy="pipeline", stages=2, microbatches=4, schedule="zbv")),
])
def test_checkpoints_move_between_pipeline_and_single_or_sync(tmp_path, single, first, then):
    """Half the run under one strategy, resumed under the other: the same end as single all along (the
    momentum buffers travel in single's layout)."""
    checkpoints = str(tmp_path / "checkpoints")
    polytrain.fit(**{**RUN, "steps": 5}, checkpoint_dir=checkpoints, **first)
    run = _fit(tmp_path, "resumed", checkpoint_dir=checkpoints, resume=True, **then)
    reference = single[1]
    for key, value in reference.items():
        assert torch.linalg.vector_norm((run[1][key] - value).double()) <= 1e-5 * torch.linalg.vector_norm(
            value.double()) + 1e-7, key
    assert run[2] == pytest.approx(single[2][1:], rel=1e-5)  # the step-10 record (step 5's was the first run's)
    # the last checkpoint's momentum is single's: a stage's state comes from its owner, not from a rank
    # that merely loaded the resumed checkpoint
    ours, theirs = (load_checkpoint(Checkpointer(d).latest())["optimizer"]["state"]
                    for d in (checkpoints, single[3]))
    assert ours.keys() == theirs.keys()
    for index, state in theirs.items():
        buffer = state["momentum_buffer"].double()
        assert torch.linalg.vector_norm(ours[index]["momentum_buffer"].double() - buffer) <= \
            1e-5 * torch.linalg.vector_norm(buffer) + 1e-7, index


@pytest.mark.parametrize("settings, message", [
    (dict(stages=2, microbatches=3), "--microbatches 3 does not divide each pipeline's batch of 8 examples"),
    (dict(stages=8, microbatches=8, schedule="gpipe"), "8 stages but the model has only 6 splittable units"),
    (dict(stages=2, schedule="interleaved-1f1b", microbatches=4, model="transformer_lm:layers=1,dim=32,heads=2"),
     "4 stages but the model has only 3 splittable units"),
    (dict(stages=2, split_at="blocks.7"), "--split-at blocks.7: no such unit; the model's units are embed, "),
    (dict(strategy="hybrid", workers=3, pp=2), "--workers 3 is not a multiple of --pp 2 = 2; pass --workers 2"),
    (dict(stages=2, accumulate=2), "accumulates over its --microbatches; pass --microbatches 8"),
    (dict(stages=2, loss="model"), "--loss model: the forward of --model transformer_lm:.* takes no labels="),
])
def test_bad_settings_are_one_line_before_any_process(settings, message):
    run = {**RUN, "strategy": "pipeline", **settings}
    with pytest.raises(ConfigError, match=message) as caught:  # a ConfigError here: raised in this process
        polytrain.fit(**run)
    assert "\n" not in str(caught.value)


def _own_loop_pipeline(ctx):
    return polytrain.strategy("pipeline", ctx)


def test_an_own_loop_pipeline_in_one_process_is_one_line():
    with pytest.raises(ConfigError, match="^--strategy pipeline needs one process per stage; it cannot run in one "
                                          "process$"):
        polytrain.launch(_own_loop_pipeline, workers=1)
