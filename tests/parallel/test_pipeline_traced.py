"""A Hugging Face GPT-2 with tied embeddings, from a user factory, pipelined through the tracer
(parallel/pp/traced.py): gpipe and 1f1b, 2 and 4 stages, --loss task and model, each equal to single
on the whole batch after 8 steps; the tied tensor held once in what is saved; each rank holding only its
stages; a split point naming no module and a model the tracer cannot handle, one line each.

Every case of one world size runs in the same worker processes, one after the other, forked from the test's
process (``POLYTRAIN_START_METHOD=fork``), which has imported transformers already: a worker from the forkserver
imported it anew (about 2 s of CPU each, 6 workers). Skipped where ``transformers`` is not installed."""

from __future__ import annotations

import pytest
import torch

import polytrain
from polytrain.config import make_config
from polytrain.distributed.launch import launch
from polytrain.errors import ConfigError
from polytrain.strategies import get_strategy
from polytrain.train.trainer import train_worker
from tests.helpers.threads import one_thread

pytest.importorskip("transformers")

GPT2 = "tests.strategies.hf_gpt2:gpt2"
# SGD: GPT-2's key bias has a zero gradient in exact arithmetic, which Adam would scale up from rounding noise.
# test_fraction 0.005: 119 test windows, not 2,391 (the final evaluation runs the traced graph one micro-batch of 2
# at a time, through torch.fx's interpreter: with 10 % of the text it was three quarters of each case's time)
RUN = dict(model=GPT2, data="text:seq_len=16,test_fraction=0.005", batch_size=8, optimizer="sgd", lr=0.5, steps=8,
           progress="off", log_every=8, eval_every=0, seed=0, microbatches=4, strategy="pipeline")
CASES = {  # name: (stages, settings)
    "2-gpipe-task": (2, dict(schedule="gpipe", split_at="transformer.h.2")),
    "2-1f1b-model": (2, dict(schedule="1f1b", loss="model")),
    "2-branchy": (2, dict(model="tests.strategies.hf_gpt2:branchy", split_at="transformer.h.1")),
    "4-1f1b-task": (4, dict(schedule="1f1b", split_at="transformer.h.1,transformer.h.2,transformer.h.3")),
}  # (4 stages, gpipe, --loss model, --split-at auto: also equal, 1.4e-6; left out for the suite's time)


def _cases(ctx, runs):
    """Each case in turn in these workers: its summary, or its error's one line."""
    done = {}
    for name, config in runs:
        try:
            done[name] = train_worker(ctx, config)
        except ConfigError as exc:
            done[name] = str(exc)
    return done


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POLYTRAIN_START_METHOD", "fork")
        return _runs(tmp_path_factory)


def _runs(tmp_path_factory):
    path = tmp_path_factory.mktemp("traced")
    saved = {}
    with one_thread():
        for loss in ("task", "model"):
            polytrain.fit(**{**RUN, "strategy": "single", "loss": loss, "save_model": str(path / f"single-{loss}.pt")})
    for stages in (2, 4):
        runs = []
        for name, (size, settings) in CASES.items():
            if size == stages:
                runs.append((name, make_config(**{**RUN, "stages": stages, **settings,
                                                  "save_model": str(path / f"{name}.pt")})))
        layout = get_strategy("pipeline").layout(None, runs[0][1].pipeline)
        saved.update(launch(_cases, runs, workers=stages, layout=layout, device="cpu", backend="gloo",
                            timeout=120, threads_per_worker=1)[0])
    return path, saved


@pytest.mark.parametrize("name", [n for n in CASES if "branchy" not in n])
def test_a_tied_gpt2_from_a_factory_pipelined_equals_single(runs, name):
    path, summaries = runs
    stages, settings = CASES[name]
    summary = summaries[name]
    loss = settings.get("loss", "task")
    single = torch.load(path / f"single-{loss}.pt", weights_only=True)
    got = torch.load(path / f"{name}.pt", weights_only=True)
    assert got.keys() == single.keys() and summary["steps"] == 8
    for key, value in single.items():
        assert (got[key] - value).norm() <= 1e-5 * value.norm(), key
    # the tied tensor is one tensor in the file, as single saves it
    assert got["lm_head.weight"].data_ptr() == got["transformer.wte.weight"].data_ptr()
    # each rank holds only its stages: together the whole model, the tied tensor on its two ranks
    whole = sum(v.numel() for v in single.values() if v is not single["lm_head.weight"])
    held = summary["rank_pp_parameters"]
    assert len(held) == stages and sum(held) == whole + single["lm_head.weight"].numel()
    assert max(held) < whole / 2 + single["lm_head.weight"].numel()
    assert len(summary["pipeline_split"]) == stages


def test_a_split_point_naming_no_module_is_one_line_before_launch():
    with pytest.raises(ConfigError, match=r"^--split-at transformer\.h\.9: the model has no module of that name; "
                                          r"name the modules that start stages 1\.\. \(its layers transformer\.h\.0 "
                                          r"\.\. transformer\.h\.3\)$"):
        polytrain.fit(**{**RUN, "stages": 2, "split_at": "transformer.h.9"})


def test_a_model_the_tracer_cannot_handle_is_one_line_before_training(runs):
    message = runs[1]["2-branchy"]
    assert message.startswith("--model _Branchy cannot be traced for a pipeline split (") and "\n" not in message
    assert message.endswith("or give --strategy pipeline an nn.Sequential of blocks")


def test_plan_prints_the_traced_split_and_each_ranks_part(capsys):
    from polytrain.cli.main import main

    assert main(["plan", "--strategy", "pipeline", "--stages", "2", "--model", GPT2, "--data", "text:seq_len=16",
                 "--batch-size", "8", "--split-at", "transformer.h.2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline split (traced, --split-at; not timed; stages start at transformer.h.2):\n" \
           "  stage 0 (rank 0): transformer.wte .. lm_head (5 modules), 34,112 parameters\n" \
           "  stage 1 (rank 1): transformer.h.2 .. lm_head (4 modules), 33,664 parameters\n" in out
    assert "  0     stage 0 (transformer.wte .. lm_head)  133.2 KiB" in out  # 34,112 float32 parameters


def test_split_points_out_of_order_too_many_stages_or_never_called_are_one_line_each():
    from torch import nn

    from polytrain.parallel.pp import traced
    from tests.strategies.hf_gpt2 import gpt2

    with torch.device("meta"):
        model = gpt2(layers=4)
    with pytest.raises(ConfigError, match=r"^--split-at transformer\.h\.3,transformer\.h\.1: split points must be "
                                          r"distinct and in the model's order of modules$"):
        traced.check_starts(model, ["transformer.h.3", "transformer.h.1"], 3)
    with pytest.raises(ConfigError, match=r"^--split-at auto: 5 stages but the model's longest list of layers "
                                          r"\(transformer\.h\) has 4; use fewer stages or name the split points"):
        traced.check_auto(model, 5)

    class Unused(nn.Module):  # c is never called: a split there makes no stage
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    with pytest.raises(ConfigError, match=r"^--split-at c: the traced forward gives 1 stages, not 2 \(a split "
                                          r"point that the forward calls more than once, or not at all\)"):
        traced.trace(Unused(), torch.randn(2, 4), {}, traced.TracedSplit(("c",), "--split-at"), "task", "Unused")
