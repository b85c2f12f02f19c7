"""Tensor parallel in real gloo processes: ``--strategy tp`` (plain --tp over four ranks, and dp 2 x tp 2) and
``hybrid --tp 2 --pp 2`` end where ``single`` ends on the whole batch (Adam, clipping, 8 steps), and a tp
checkpoint, in single's layout, resumes under hybrid's tp x pp and ends there too; an MLP split by a plan
given as a TOML file (--tp-plan) ends where single ends. All cases run in one launch of four workers (one
Trainer after another on the same world)."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import make_config
from polytrain.distributed.topology import Topology
from polytrain.train.checkpoint import load_checkpoint
from tests.helpers.spawn import spawn

LM = dict(model="transformer_lm:layers=2,dim=32,heads=4", data="text:seq_len=16", batch_size=16)
COMMON = dict(steps=8, seed=5, progress="off", eval_every=8, log_every=4, optimizer="adam", lr=0.003,
              clip_grad_norm=0.5, **LM)
MLP = dict(model="mlp:hidden=32", data="digits", batch_size=16, steps=8, seed=5, progress="off", eval_every=8,
           log_every=4, optimizer="adam", lr=0.01)
PLAN = '"1" = "colwise"  # Flatten, Linear(64, 32), ReLU, Linear(32, 10)\n"3" = "rowwise"\n'
TP_PP = dict(strategy="hybrid", dp=1, pp=2, tp=2, microbatches=2, split_at="blocks.1")
CASES = {
    "tp4": dict(strategy="tp", workers=4, tp=4),  # plain --tp: the four ranks one tensor-parallel group
    "dp2_tp2": dict(strategy="tp", workers=4, tp=2),
    "tp2_pp2": TP_PP,
    # a tp run checkpointed at step 4, resumed to step 8 by hybrid's tp x pp
    "first_half": dict(strategy="tp", workers=4, tp=2, steps=4, checkpoint_every=4),
    "resumed": dict(TP_PP, resume=True),
    "mlp_plan": dict(strategy="tp", workers=4, tp=2),  # MLP's settings, --tp-plan the file
}


def _fit_cases(ctx, cases, folder):
    from polytrain.train.run import layout_of
    from polytrain.train.trainer import Trainer

    out = {}
    for name, settings in cases.items():
        extra = {"checkpoint_dir": f"{folder}/ck"} if name in ("first_half", "resumed") else {}
        base = COMMON if name != "mlp_plan" else {**MLP, "tp_plan": f"{folder}/plan.toml"}
        config = make_config(**{**base, **settings, **extra, "save_model": f"{folder}/{name}.pt"})
        summary = Trainer(config, ctx.topology, layout=layout_of(config)).fit()
        out[name] = (summary.get("eval_loss"), summary.get("train_loss"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from polytrain.train.trainer import Trainer

    folder = tmp_path_factory.mktemp("tp")
    (folder / "plan.toml").write_text(PLAN)
    references = {}
    for name, settings in (("single", COMMON), ("single_mlp", MLP)):
        summary = Trainer(make_config(**settings, strategy="single", save_model=str(folder / f"{name}.pt")),
                          Topology()).fit()
        references[name] = (summary["eval_loss"], summary["train_loss"])
    results = spawn(_fit_cases, 4, CASES, str(folder), timeout=240)[0]
    return folder, references, results


@pytest.mark.parametrize("case", ["tp4", "dp2_tp2", "tp2_pp2", "resumed", "mlp_plan"])
def test_tensor_parallel_equals_single(runs, case):
    folder, references, results = runs
    single = "single_mlp" if case == "mlp_plan" else "single"
    eval_loss, train_loss = references[single]
    reference = torch.load(folder / f"{single}.pt", weights_only=True)
    weights = torch.load(folder / f"{case}.pt", weights_only=True)  # single's layout: every key, whole shapes
    assert weights.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-5, msg=key)
    assert results[case][0] == pytest.approx(eval_loss, rel=1e-5)
    if case != "resumed":  # (the resumed run's train loss covers its own steps only)
        assert results[case][1] == pytest.approx(train_loss, rel=1e-5)


def test_a_tp_checkpoint_is_single_layout(runs):
    folder, _, _ = runs
    saved = load_checkpoint(folder / "ck" / "step-00000004.pt")
    reference = torch.load(folder / "single.pt", weights_only=True)
    assert {k: v.shape for k, v in saved["model"].items()} == {k: v.shape for k, v in reference.items()}
    states = saved["optimizer"]["state"]
    assert sorted(states) == list(range(len(reference)))  # Adam's state for every parameter, single's indices
    assert states[6]["exp_avg"].shape == reference["blocks.0.attn.qkv.weight"].shape
