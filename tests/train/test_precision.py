"""--precision: bf16-mixed and 16-mixed (autocast, float32 master weights, 16-mixed's loss scaler and its skipped
steps), bf16-true (bfloat16 parameters and optimizer state, float32 checkpoints), and what each strategy refuses.

Tolerances, as measured on this repository's 2-core CPU machine (docs/precision.md):

* bf16-mixed ``sync`` vs ``single``: the forward of each example is the same in bfloat16 whatever the slice
  (step 1's losses agree to 1.3e-7, the float32 mean of two halves), but a weight's gradient is a bfloat16
  matrix product summed over 512 token rows in ``single`` and over 256 on each worker in ``sync`` (then summed
  in float32 by the all-reduce), so the two round differently (2^-9 relative per element), and Adam's
  normalised step carries that into every weight: the losses of the first 10 steps differ by at most 1.9e-4
  relative (bound 1e-3), and the trajectories then drift apart as two float32 runs of another summation order
  do, only sooner (float32: 4.6e-4 at most over 200 steps). After 200 steps the evaluation losses differ by
  0.11 % (bound 1 %), and each is within 0.1 % of float32's (bound 2 %).
"""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.errors import DeviceError
from polytrain.log import get_logger
from polytrain.precision import Amp, Precision
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.trainer import Trainer
from tests.helpers.cli_batch import run_here

LM = dict(model="transformer_lm:layers=1,dim=32,heads=2", data="text:seq_len=32", batch_size=16, optimizer="adam",
          lr=0.01, progress="off", log_every=1, eval_every=0, seed=0, threads_per_worker=1)


def _losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["event"] == "step"]


def _records(path, event="step"):
    return [r for r in map(json.loads, open(path)) if r["event"] == event]


def _rel(a, b):
    return abs(a - b) / abs(b)


class _Lines(logging.Handler):
    """The messages polytrain's logger gives (it does not propagate to pytest's caplog)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# -- bf16-mixed: single and sync against float32 -----------------------------------------------------------

@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """200 steps of a small transformer_lm: single in float32, single and sync (2 workers) in bf16-mixed."""
    out = tmp_path_factory.mktemp("precision")
    runs = {"single-32": dict(strategy="single", precision="32-true"),
            "single-bf16": dict(strategy="single", precision="bf16-mixed"),
            "sync-bf16": dict(strategy="sync", workers=2, precision="bf16-mixed")}
    summaries = {name: polytrain.fit(steps=200, metrics_file=str(out / f"{name}.jsonl"), **LM, **settings)
                 for name, settings in runs.items()}
    return {name: (summaries[name], _losses(out / f"{name}.jsonl")) for name in runs}


def test_bf16_mixed_single_and_sync_reach_float32s_loss_in_200_steps(lm_runs):
    reference, losses = lm_runs["single-32"]  # sync in float32 equals single (test_lm_training.py)
    assert len(losses) == 200 and losses[0] > 5.0 and reference["eval_loss"] < 2.7  # it learnt (ln 256 = 5.55)
    for name in ("single-bf16", "sync-bf16"):
        summary, trajectory = lm_runs[name]
        assert len(trajectory) == 200 and summary["steps"] == 200
        assert _rel(summary["eval_loss"], reference["eval_loss"]) < 0.02, (name, summary["eval_loss"])


def test_bf16_mixed_sync_equals_single_within_bfloat16s_rounding(lm_runs):
    (single, one), (sync, two) = lm_runs["single-bf16"], lm_runs["sync-bf16"]
    assert _rel(two[0], one[0]) < 1e-6  # the same forward per example: only the float32 mean's order differs
    assert max(_rel(b, a) for a, b in zip(one[:10], two[:10])) < 1e-3
    assert _rel(sync["eval_loss"], single["eval_loss"]) < 0.01


def test_the_opening_lines_name_the_precision():
    for name, words in [("32-true", "precision 32-true: float32"),
                        ("bf16-mixed", "precision bf16-mixed: forward and loss under autocast to bfloat16"),
                        ("16-mixed", "loss scaled (initial scale 1024)")]:
        scale = {"initial_loss_scale": 1024} if name == "16-mixed" else {}
        trainer = Trainer(make_config(strategy="single", model="mlp:hidden=8", data="digits", steps=1,
                                      precision=name, **scale))
        assert words in trainer.session.describe()


# -- 16-mixed: the loss scaler ------------------------------------------------------------------------------

def test_16_mixed_on_sync_counts_the_steps_its_scaler_skips(tmp_path):
    # a first scale of 2^40 overflows float16 gradients: the scaler skips those steps, halving the scale each
    # time (no growth before 2000 good steps), until the gradients fit; then it trains
    metrics = tmp_path / "m.jsonl"
    summary = polytrain.fit(strategy="sync", workers=2, steps=60, precision="16-mixed", initial_loss_scale=2.0 ** 40,
                            metrics_file=str(metrics), **{**LM, "log_every": 10})
    skipped = summary["precision_skipped_steps"]
    assert summary["rank_precision_skipped_steps"] == [skipped, skipped]  # exchanged before the update: alike
    assert skipped == round(math.log2(2.0 ** 40 / summary["precision_loss_scale"]))
    assert 15 <= skipped < 50
    records = _records(metrics)
    assert [sum(r["rank_precision_skipped_steps"][0] for r in records)] == [skipped]
    assert records[0]["rank_precision_skipped_steps"] == [10, 10]  # the first ten steps all overflowed
    assert records[-1]["rank_loss_scale"][0] == summary["precision_loss_scale"]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0  # it trained once the scale fit


def test_16_mixed_unscales_before_clipping_the_exchanged_gradient(tmp_path):
    # clipped while still scaled (a norm ~65536 times the true one) to 0.5, SGD's steps would be ~65536 times too
    # small and the loss would stay at ln 256; unscaled first, 16-mixed follows float32 (until float16's rounding,
    # amplified by lr 0.5, shows: 4e-5 relative over the first 5 steps), and sync follows single
    common = dict(LM, optimizer="sgd", lr=0.5, clip_grad_norm=0.5, steps=15)
    polytrain.fit(strategy="single", metrics_file=str(tmp_path / "a.jsonl"), **common)
    polytrain.fit(strategy="single", precision="16-mixed", metrics_file=str(tmp_path / "b.jsonl"), **common)
    polytrain.fit(strategy="sync", workers=2, precision="16-mixed", metrics_file=str(tmp_path / "c.jsonl"), **common)
    fp32, single, sync = (_losses(tmp_path / f"{n}.jsonl") for n in "abc")
    assert fp32[4] < fp32[0] - 1.0  # the clipped steps move it
    assert max(_rel(b, a) for a, b in zip(fp32[:5], single[:5])) < 1e-3
    assert max(_rel(b, a) for a, b in zip(single, sync)) < 1e-3
    assert sync[-1] < sync[0] - 1.5


# -- bf16-true ------------------------------------------------------------------------------------------------

BF16_TRUE = dict(strategy="single", model="mlp:hidden=32", data="digits", batch_size=32, optimizer="adam", lr=0.01,
                 progress="off", eval_every=0, seed=2, precision="bf16-true")


def test_bf16_true_trains_with_bfloat16_parameters_and_optimizer_state(tmp_path):
    trainer = Trainer(make_config(steps=30, log_every=30, checkpoint_dir=str(tmp_path / "c"), **BF16_TRUE))
    summary = trainer.fit()
    model, optimizer = trainer.strategy.module, trainer.strategy.optimizer
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.grad.dtype for p in model.parameters()} == {torch.bfloat16}
    moments = [state[key] for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}
    assert summary["eval_accuracy"] > 0.8  # digits: 10 classes
    assert "precision bf16-true: parameters, gradients and optimizer state in bfloat16" in trainer.session.describe()
    # the checkpoint holds float32: the bfloat16 values widened, exactly
    saved = torch.load(Checkpointer(tmp_path / "c").latest(), weights_only=True)
    for name, value in model.state_dict().items():
        assert saved["model"][name].dtype == torch.float32 and torch.equal(saved["model"][name], value.float())
    assert all(v.dtype == torch.float32 for s in saved["optimizer"]["state"].values()
               for k, v in s.items() if k != "step")


def test_a_bf16_true_run_resumes_bit_for_bit(tmp_path):
    whole, resumed = tmp_path / "whole.pt", tmp_path / "resumed.pt"
    polytrain.fit(steps=20, save_model=str(whole), **BF16_TRUE)
    ckpt = str(tmp_path / "c")
    polytrain.fit(steps=10, checkpoint_dir=ckpt, **BF16_TRUE)
    polytrain.fit(steps=20, checkpoint_dir=ckpt, resume=True, save_model=str(resumed), **BF16_TRUE)
    a, b = torch.load(whole, weights_only=True), torch.load(resumed, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.float32}  # --save-model: float32, as checkpoints


def test_a_bf16_true_checkpoint_resumes_in_float32_unchanged(tmp_path):
    # across precisions: a bf16-true checkpoint's values continue in float32 exactly (the other way, a float32
    # checkpoint resumed in bf16-true, is rounded to bfloat16 once)
    ckpt = tmp_path / "c"
    polytrain.fit(steps=10, checkpoint_dir=str(ckpt), **BF16_TRUE)
    saved = torch.load(Checkpointer(ckpt).latest(), weights_only=True)
    logger, lines = get_logger(), _Lines()
    level, _ = logger.level, logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        trainer = Trainer(make_config(steps=15, checkpoint_dir=str(ckpt), resume=True,
                                      **{**BF16_TRUE, "precision": "32-true"}))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    model = trainer.strategy.module
    assert trainer.session.start_step == 10
    for name, value in model.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, saved["model"][name])
    assert ("--resume: the checkpoint was trained with --precision bf16-true, this run has 32-true: its bfloat16 "
            "values continue in float32 unchanged") in lines.messages
    summary = trainer.fit()
    assert summary["steps"] == 15 and {p.dtype for p in model.parameters()} == {torch.float32}


# -- pipeline: autocast around each stage's forward -----------------------------------------------------------

def test_bf16_mixed_pipeline_sends_bfloat16_activations_and_follows_single(tmp_path):
    # the cut is after a Linear, whose output autocast makes bfloat16: the activations sent forward and their
    # gradients sent back are half float32's bytes, so the stages inferred the dtype under autocast too
    common = dict(model="mlp:hidden=32", data="digits", batch_size=32, optimizer="adam", lr=0.01, progress="off",
                  eval_every=0, seed=0, steps=10, log_every=10, threads_per_worker=1)
    pipe = dict(strategy="pipeline", stages=2, microbatches=2, split_at="2")
    fp32 = polytrain.fit(precision="32-true", metrics_file=str(tmp_path / "p32.jsonl"), **common, **pipe)
    bf16 = polytrain.fit(precision="bf16-mixed", metrics_file=str(tmp_path / "p16.jsonl"), **common, **pipe)
    single = polytrain.fit(strategy="single", precision="bf16-mixed", **common)
    sent = [_records(tmp_path / f"{n}.jsonl")[-1]["rank_bytes_sent"] for n in ("p32", "p16")]
    assert sent[1][0] * 2 == sent[0][0] > 0 and sent[1][1] * 2 == sent[0][1] > 0
    assert _rel(bf16["train_loss"], single["train_loss"]) < 1e-3
    assert _rel(bf16["train_loss"], fp32["train_loss"]) < 1e-2
    assert _rel(bf16["eval_loss"], single["eval_loss"]) < 1e-3  # evaluation's forward chain under autocast too


# -- what is refused, and where ---------------------------------------------------------------------------

REFUSED = [
    (["--precision", "8-bit"], "--precision: unknown value '8-bit'; accepted: 32-true, bf16-mixed, 16-mixed, bf16-true"),
    (["--strategy", "async", "--precision", "16-mixed"],
     "--precision 16-mixed needs a loss scaler, which --strategy async cannot apply (the parameter servers apply "
     "each worker's gradient alone, so no step can be skipped for every worker at once); use --precision "
     "bf16-mixed (no loss scaling needed) or 32-true"),
    (["--strategy", "pipeline", "--precision", "16-mixed"],
     "--precision 16-mixed needs a loss scaler, which --strategy pipeline cannot apply (the pipelining schedule "
     "runs each micro-batch's backward itself, and an overflow on one stage would have to skip the step on all); "
     "use --precision bf16-mixed (no loss scaling needed) or 32-true"),
    (["--precision", "bf16-mixed", "--initial-loss-scale", "1024"],
     "--initial-loss-scale is read by --precision 16-mixed only (this run has --precision bf16-mixed, which scales "
     "no loss); drop it or pass --precision 16-mixed"),
]


@pytest.mark.parametrize("args, message", REFUSED)
def test_precision_settings_that_cannot_work_are_one_line(capsys, args, message):
    """Through the command's main in this process: each is refused before anything starts."""
    proc = run_here(capsys, "train", "--steps", "1", *args)
    assert proc.returncode == 2
    assert proc.stdout == ""  # nothing started
    assert proc.stderr.strip().splitlines() == [f"polytrain: error: {message}"], proc.stderr


def test_a_device_without_autocast_is_refused():
    with pytest.raises(DeviceError, match=re.escape("--precision bf16-mixed: torch has no autocast on meta; use "
                                                    "--precision 32-true or another device")):
        Amp(Precision("bf16-mixed"), "meta")
    own = Amp(Precision("16-mixed"), "meta", active=False)  # a mode the strategy carries out itself: nothing added
    assert own.scaler is None and own.describe() == "16-mixed, carried out by the strategy"
