"""``hybrid --shard-dp`` in real gloo processes: each stage fully_shard-ed over its dp replicas ends where
``single`` ends (Adam, clipping), each rank holds about half its stage's state at --dp 2, and checkpoints move
between it and ``pipeline`` bit for bit."""

from __future__ import annotations

import shutil

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.train.checkpoint import load_checkpoint
from tests.helpers.resume import assert_same_state, resume_and_read_back
from tests.helpers.spawn import spawn
from tests.helpers.tensor_bytes import local_bytes

LM = dict(model="transformer_lm:layers=2,dim=32,heads=2", data="text:seq_len=16", batch_size=16)
COMMON = dict(steps=10, seed=5, progress="off", eval_every=5, log_every=5, optimizer="adam", lr=0.003,
              clip_grad_norm=0.5, timeout=120, **LM)
SHARDED = dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2, split_at="blocks.1", shard_dp=True)
PIPELINE = dict(strategy="pipeline", stages=2, microbatches=2, split_at="blocks.1")


def _fit(tmp_path, name, **settings):
    path = tmp_path / f"{name}.pt"
    summary = polytrain.fit(**{**COMMON, **settings}, save_model=str(path))
    return summary, torch.load(path, weights_only=True)


def test_sharded_hybrid_equals_single(tmp_path):
    single, reference = _fit(tmp_path, "single", strategy="single")
    sharded, weights = _fit(tmp_path, "sharded", **SHARDED)
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert sharded["eval_loss"] == pytest.approx(single["eval_loss"], rel=1e-5)
    assert sharded["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5)
    assert sharded["bytes_sent"] > 0


def _held(ctx, settings):
    """This rank's parameter, gradient and optimizer bytes after two steps (local shards only)."""
    from polytrain.train.trainer import Trainer

    config = make_config(**{**COMMON, **settings, "steps": 2, "eval_every": 0})
    trainer = Trainer(config, ctx.topology, layout=ctx.layout)
    trainer.fit()
    model, optimizer = trainer.strategy.model, trainer.strategy.optimizer
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return local_bytes(params) + local_bytes(p.grad for p in params) + local_bytes(states)


def test_each_rank_holds_about_half_of_its_stage_state():
    from polytrain.distributed.launch import launch
    from polytrain.train.run import layout_of

    def run(settings):
        config = make_config(**{**COMMON, **settings})
        return launch(_held, settings, layout=layout_of(config), threads_per_worker=1, timeout=120)

    sharded = run(SHARDED)
    replicated = run({**SHARDED, "shard_dp": False})
    for held, whole in zip(sharded, replicated):
        assert whole > 0 and 0.45 * whole <= held <= 0.55 * whole, (held, whole)


def _resume(tmp_path, source, target):
    """A run of ``source`` to step 4 resumed by ``target`` to step 6: what the target holds before its first
    step, the file it resumed, and the model it ends with; and ``source`` resumed alike, its end."""
    ckpt = tmp_path / "ck"
    polytrain.fit(**{**COMMON, "steps": 4, **source}, checkpoint_dir=str(ckpt))
    shutil.copytree(ckpt, tmp_path / "again")
    saved = load_checkpoint(ckpt / "step-00000004.pt")
    config = make_config(**{**COMMON, "steps": 6, **target}, checkpoint_dir=str(ckpt), resume=True,
                         save_model=str(tmp_path / "target.pt"))
    held, _ = spawn(resume_and_read_back, target.get("workers", target.get("stages")), config)[0]
    polytrain.fit(**{**COMMON, "steps": 6, **source}, checkpoint_dir=str(tmp_path / "again"), resume=True,
                  save_model=str(tmp_path / "source.pt"))
    return held, saved, *(torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("target", "source"))


@pytest.mark.parametrize("source, target", [(SHARDED, PIPELINE), (PIPELINE, SHARDED)],
                         ids=["sharded-to-pipeline", "pipeline-to-sharded"])
def test_a_checkpoint_moves_between_sharded_hybrid_and_pipeline_bit_for_bit(tmp_path, source, target):
    held, saved, ended, reference = _resume(tmp_path, source, target)
    assert_same_state(held, saved)
    for key, value in reference.items():  # the moments went into the shards: two more steps end alike
        torch.testing.assert_close(ended[key], value, rtol=1e-5, atol=1e-5, msg=key)


@pytest.mark.parametrize("settings, message", [
    (PIPELINE, "^--shard-dp is a setting of --strategy hybrid, which --strategy pipeline does not read"),
    ({**SHARDED, "workers": 2, "dp": 1}, "^--shard-dp with --dp 1 shards nothing"),
], ids=["pipeline", "dp-1"])
def test_the_option_is_refused_in_one_line_before_any_process(settings, message):
    with pytest.raises(ConfigError, match=message) as caught:  # raised in this process
        polytrain.fit(**{**COMMON, **settings, "shard_dp": True})
    assert "\n" not in str(caught.value)
