"""``pipeline`` and ``hybrid`` never hold the whole model: each rank makes only its stages' units from the meta
device, one at a time, with ``single``'s initial values (rank 0 of ``--split-at auto`` makes each other unit
only while timing it); a model that cannot be built on the meta device is built whole, with one warning."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import polytrain
from polytrain.config import make_config
from polytrain.models import build_model

MODEL = "transformer_lm:layers=6,dim=32,heads=2"  # units: embed, blocks.0-5, head
SEQ = 16
SEED = 3


def _built(ctx, settings):
    """This rank's part: what it held before first use, after first use (an evaluation, which cuts the
    model) and after a step; the most it held while making it; its units' initial values and every
    unit's whole size."""
    from polytrain.models.deferred import held_bytes, unit_bytes
    from polytrain.train.trainer import Trainer

    config = make_config(model=MODEL, data=f"text:seq_len={SEQ}", batch_size=8, optimizer="adam", steps=1,
                         eval_every=0, progress="off", seed=SEED, **settings)
    trainer = Trainer(config, ctx.topology, layout=ctx.layout)
    strategy, model = trainer.strategy, trainer.strategy.model
    sizes, before = unit_bytes(model), held_bytes(model)  # sizes from shapes: meta tensors count whole
    tokens = torch.randint(0, model.vocab_size, (8, SEQ), generator=torch.Generator().manual_seed(0))
    strategy.eval_step(tokens, tokens)  # first use: the split chosen or checked, this rank's stages made
    names = [n for stage in strategy.mine for n in strategy.split.stage_units(stage)]
    initial = {k: v.clone() for k, v in model.state_dict().items() if k.startswith(tuple(f"{n}." for n in names))}
    peak = model.materialized_peak_bytes
    trainer.fit()
    optimized = sum(len(group["params"]) for group in strategy.optimizer.param_groups)
    return dict(names=names, sizes=sizes, before=before, peak=peak, held=held_bytes(model), initial=initial,
                vocab=model.vocab_size, optimized=optimized, dp=strategy.topology.axis_rank("dp"))


CASES = {
    "pipeline-2-interleaved-auto": (2, dict(strategy="pipeline", stages=2, microbatches=2,
                                            schedule="interleaved-1f1b")),
    "pipeline-4-named": (4, dict(strategy="pipeline", stages=4, microbatches=4,
                                 split_at="blocks.1,blocks.3,blocks.5")),
    "hybrid-2x2-auto": (4, dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_makes_only_its_stages_with_singles_values(case):
    from polytrain.distributed.launch import launch
    from polytrain.train.run import layout_of

    processes, settings = CASES[case]
    ranks = launch(_built, settings, workers=processes, layout=layout_of(make_config(**settings)),
                   threads_per_worker=1, timeout=120)
    reference = build_model(MODEL, input_shape=(SEQ,), num_classes=ranks[0]["vocab"], seed=SEED)
    whole = reference.state_dict()
    parameters = len(list(reference.parameters()))
    sizes = ranks[0]["sizes"]
    assert sorted(n for r in ranks if r["dp"] == 0 for n in r["names"]) == sorted(sizes)  # the model once
    for rank in ranks:
        own = sum(sizes[n] for n in rank["names"])
        assert 0 < own < sum(sizes.values())
        named = "split_at" in settings  # made in prepare; for auto, nothing before the split is chosen
        assert rank["before"] == (own if named else 0)
        assert rank["peak"] <= own + 1.5 * max(sizes.values()), (rank["names"], rank["peak"], own)
        assert rank["held"] == own  # after a step: its stages' parameters and buffers, the rest 0 bytes
        assert rank["optimized"] == parameters  # every parameter, numbered as single numbers them
        assert rank["initial"] and all(torch.equal(v, whole[k]) for k, v in rank["initial"].items())


class Plain(nn.Sequential):
    pass  # no init_unit: it cannot be made unit by unit, so every rank builds it whole


def test_a_model_that_cannot_be_deferred_is_built_whole_with_one_warning(capfd, monkeypatch):
    # in this process, its workers forked from it (POLYTRAIN_START_METHOD=fork) so that what they print reaches
    # capfd (a fresh python running a script paid torch's import twice: itself and its forkserver)
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    model = Plain(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    capfd.readouterr()
    summary = polytrain.fit(model=model, data="digits", strategy="pipeline", stages=2, microbatches=2, batch_size=8,
                            steps=2, eval_every=0, progress="off", timeout=60, split_at="2")
    out = capfd.readouterr().out
    assert out.count("warning: --model Plain is built whole on every rank") == 1, out
    assert summary["rank_pp_parameters"] == [64 * 32 + 32, 32 * 10 + 10]  # each rank keeps its stage


def _state_before_first_step(ctx, settings):
    """The whole state the strategy gives before any step (rank 0's; None elsewhere)."""
    from polytrain.train.trainer import Trainer

    config = make_config(model=MODEL, data=f"text:seq_len={SEQ}", batch_size=8, optimizer="adam", steps=1,
                         progress="off", seed=SEED, **settings)
    return Trainer(config, ctx.topology, layout=ctx.layout).strategy.state_dict()


@pytest.mark.parametrize("split_at", ["auto", "blocks.2"])
def test_before_the_first_step_the_state_is_singles_initial_state_or_the_resumed_one(tmp_path, split_at):
    """Unmade (auto: nothing is made before the split) or made in part (named: each rank its stages), the
    state a checkpoint would hold is the whole model's: single's initial values, or a resumed checkpoint's
    bit for bit (model and optimizer)."""
    from polytrain.distributed.launch import launch
    from polytrain.train.run import layout_of
    from tests.helpers.resume import assert_same_state, resume_and_read_back

    settings = dict(strategy="pipeline", stages=2, microbatches=2, split_at=split_at)
    layout = layout_of(make_config(**settings))
    state = launch(_state_before_first_step, settings, workers=2, layout=layout, threads_per_worker=1,
                   timeout=120)[0]
    reference = build_model(MODEL, input_shape=(SEQ,), num_classes=state["model"]["head.out.weight"].shape[0],
                            seed=SEED).state_dict()
    assert state["model"].keys() == reference.keys()
    assert all(torch.equal(state["model"][k], v) for k, v in reference.items())
    assert state["optimizer"]["state"] == {}

    ckpt = tmp_path / "ck"
    common = dict(model=MODEL, data=f"text:seq_len={SEQ}", batch_size=8, optimizer="adam", progress="off",
                  seed=SEED, eval_every=0, timeout=120, checkpoint_dir=str(ckpt))
    polytrain.fit(**common, **settings, steps=3)
    saved = torch.load(ckpt / "step-00000003.pt", weights_only=True)
    config = make_config(**common, **settings, steps=4, resume=True)
    held, summary = launch(resume_and_read_back, config, workers=2, layout=layout, threads_per_worker=1,
                           timeout=120)[0]
    assert_same_state(held, saved)
    assert summary["steps"] == 4 and math.isfinite(summary["train_loss"])  # and trained on
