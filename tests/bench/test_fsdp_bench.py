"""``polytrain bench --suite fsdp``: the plain fully_shard loop takes polytrain fsdp's steps, and the quick suite
gives its rows, ratios and per-rank memory table."""

import argparse
import json

import pytest
import torch

from polytrain.bench.fsdp import FsdpBenchConfig, cases, format_markdown, format_text, plain_command, run_polytrain, \
    run_suite
from polytrain.cli.bench import bench_config
from polytrain.data.registry import build_data
from polytrain.errors import ConfigError
from polytrain.models.registry import build_model
from tests.bench.forked import run_script

TINY = FsdpBenchConfig(model="transformer_lm:layers=2,dim=32,heads=2", data="text:seq_len=16", worker_batch_size=4,
                       workers=2, warmup=2, steps=3, repeats=1, optimizer="adam", lr=0.01)


def test_the_plain_loop_trains_exactly_like_polytrain_fsdp(tmp_path):
    """Same initial values, batches, Adam and loss on both sides, each sharded by fully_shard per unit and at the
    root over the same 2 ranks: after 5 steps the whole weights agree.

    Both sides run the same kernels on the same shards in the same order (polytrain's language-model loss is
    F.cross_entropy's token mean, divided by exactly 1 for equal slices), and the runs measured bit for bit
    equal. The bound, 1e-6 of each tensor's norm, allows only float32 rounding (a reduction reordered:
    about 1e-7, which Adam's first steps carry into the weights as a few ulps of lr): one step's change at
    lr 0.01 is about 1e-2 of the norm, so another batch, initial value, loss weight or update would fail."""
    fsdp = cases(TINY)[0]
    # the plain loop forked from this process's forkserver (tests/bench/forked.py); the quick suite below runs it as
    # the bench does, its own command
    result, err = tmp_path / "plain.json", tmp_path / "plain.err"
    assert run_script(plain_command(TINY, result, tmp_path / "plain.pt"), err) == 0, err.read_text()
    measured = json.loads(result.read_text())
    assert measured["timed_steps"] == 3 and measured["global_batch"] == 8 and measured["examples_per_sec"] > 0
    ours = run_polytrain(fsdp, TINY, 0, tmp_path, save_model=tmp_path / "fsdp.pt")
    assert ours["examples_per_sec"] > 0

    theirs, mine = torch.load(tmp_path / "plain.pt", weights_only=True), torch.load(tmp_path / "fsdp.pt",
                                                                                     weights_only=True)
    assert mine.keys() == theirs.keys()
    data = build_data(TINY.data, seed=TINY.seed)
    start = build_model(TINY.model, input_shape=data.input_shape, num_classes=data.num_outputs,
                        seed=TINY.seed).state_dict()
    for name in mine:
        assert not torch.equal(mine[name], start[name]), f"{name} did not train"
        rel = (mine[name] - theirs[name]).norm() / theirs[name].norm()
        assert rel <= 1e-6, f"{name}: relative difference {rel:.2e}"
    # each rank holds half the state on both sides, counted the same way
    for side in (measured["rank_memory_bytes"], ours["rank_memory_bytes"]):
        assert len(side) == 2
    for a, b in zip(measured["rank_memory_bytes"], ours["rank_memory_bytes"]):
        assert (a["parameters"], a["gradients"], a["optimizer"]) == (b["parameters"], b["gradients"], b["optimizer"])


def test_the_quick_suite_gives_rows_ratios_and_the_memory_table():
    args = argparse.Namespace(suite="fsdp", quick=True, plan=False, json=None, markdown=None, plot=None,
                              model=None, data=None, worker_batch_size=None, workers=None, batch_size=None,
                              stages=None, microbatches=None, schedules=None, warmup=None, steps=None,
                              repeats=None, lr=None, optimizer=None, seed=None, timeout=None, host_memory=None)
    cfg = bench_config(args)
    assert isinstance(cfg, FsdpBenchConfig) and cfg.repeats == 1 and cfg.steps == 2
    doc = run_suite(cfg)
    assert [row["case"] for row in doc["rows"]] == ["fsdp", "plain", "sync"]
    for row in doc["rows"]:
        assert row["examples_per_sec"] > 0 and row["tokens_per_sec"] == pytest.approx(16 * row["examples_per_sec"],
                                                                                     rel=1e-3)
        assert [m["rank"] for m in row["memory"]] == [0, 1]
        assert all(m["peak_mb"] > 0 and m["state_mb"] > 0 for m in row["memory"])
    ratios = {r["key"]: r for r in doc["ratios"]}
    assert ratios["fsdp_vs_plain"]["target"] == 0.98 and len(ratios["fsdp_vs_plain"]["per_repeat"]) == 1
    assert ratios["fsdp_vs_plain"]["min"] <= ratios["fsdp_vs_plain"]["value"] <= ratios["fsdp_vs_plain"]["max"]
    memory = {row["case"]: row["memory"] for row in doc["rows"]}
    for sharded, plain, whole in zip(memory["fsdp"], memory["plain"], memory["sync"]):
        assert sharded["state_mb"] == plain["state_mb"] < whole["state_mb"]  # sharded: about half of a replica
    text, markdown = format_text(doc), format_markdown(doc)
    assert "polytrain fsdp / plain fully_shard loop" in text and "memory per rank" in text
    assert markdown.count("| fsdp | ") == 2 and "| plain | 1 |" in markdown


def test_settings_the_suite_cannot_run_are_one_line():
    with pytest.raises(ConfigError, match="--workers must be >= 2"):
        FsdpBenchConfig(workers=1).check()
    with pytest.raises(ConfigError, match="--optimizer must be adam or sgd"):
        FsdpBenchConfig(optimizer="rmsprop").check()
