"""The benchmark's runners: the plain DDP script does exactly polytrain sync's steps, and windows are read
from real metrics files. The script runs forked from this process's forkserver (tests/bench/forked.py); the bench
runs it as its own command (tests/cli/test_bench.py, and the failing run below)."""

import json

import pytest
import torch

import polytrain
from polytrain.bench.cases import BenchConfig, plan, tokens_per_example
from polytrain.bench.measure import BenchError, ddp_command, run_case, window_from_metrics
from tests.bench.forked import run_script

SMALL = BenchConfig(model="cifar_cnn", data="synthetic:shape=3x24x24,size=64,test_size=0", worker_batch_size=4,
                    workers=2, warmup=2, steps=4, repeats=1, lr=0.05)


def test_the_ddp_script_trains_exactly_like_polytrain_sync(tmp_path):
    """Same model, data, batches, optimizer and seed: the comparison in `polytrain bench` is like for like."""
    ddp = next(c for c in plan(SMALL, cores=2) if c.key == "ddp")
    result, ddp_weights = tmp_path / "ddp.json", tmp_path / "ddp.pt"
    err = tmp_path / "ddp.err"
    assert run_script(ddp_command(ddp, SMALL, result, ddp_weights), err) == 0, err.read_text()
    measured = json.loads(result.read_text())
    assert measured["timed_steps"] == 4 and measured["global_batch"] == 8 and measured["examples_per_sec"] > 0

    polytrain.fit(model=SMALL.model, data=SMALL.data, strategy="sync", workers="2", batch_size=8, steps=6,
                  optimizer="sgd", lr=SMALL.lr, momentum=SMALL.momentum, seed=SMALL.seed, eval_every=0,
                  progress="off", save_model=str(tmp_path / "sync.pt"))
    ours = torch.load(tmp_path / "sync.pt", weights_only=True)
    theirs = torch.load(ddp_weights, weights_only=True)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert not torch.equal(ours[name], torch.zeros_like(ours[name]))
        rel = (ours[name] - theirs[name]).norm() / theirs[name].norm()
        assert rel <= 1e-5, f"{name}: relative difference {rel:.2e}"

    # the ceiling case really exchanges nothing: rank 0 then trains on its own halves only
    alone = next(c for c in plan(SMALL, cores=2) if c.key == "no_exchange")
    assert run_script(ddp_command(alone, SMALL, tmp_path / "alone.json", tmp_path / "alone.pt"), err) == 0, \
        err.read_text()
    solo = torch.load(tmp_path / "alone.pt", weights_only=True)
    assert max((solo[n] - theirs[n]).norm() / theirs[n].norm() for n in solo) > 1e-3


def test_the_ddp_script_trains_a_language_model_exactly_like_polytrain_sync(tmp_path):
    """`polytrain bench --model transformer_lm --data text`: the script's token-mean cross-entropy on the same
    windows takes polytrain sync's steps."""
    lm = BenchConfig(model="transformer_lm:layers=1,dim=32,heads=2", data="text:seq_len=16", worker_batch_size=4,
                     workers=2, warmup=2, steps=4, repeats=1, lr=0.05)
    ddp = next(c for c in plan(lm, cores=2) if c.key == "ddp")
    err = tmp_path / "ddp.err"
    assert run_script(ddp_command(ddp, lm, tmp_path / "ddp.json", tmp_path / "ddp.pt"), err) == 0, err.read_text()
    polytrain.fit(model=lm.model, data=lm.data, strategy="sync", workers="2", batch_size=8, steps=6,
                  optimizer="sgd", lr=lm.lr, momentum=lm.momentum, seed=lm.seed, eval_every=0, progress="off",
                  save_model=str(tmp_path / "sync.pt"))
    ours = torch.load(tmp_path / "sync.pt", weights_only=True)
    theirs = torch.load(tmp_path / "ddp.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert (ours[name] - theirs[name]).norm() <= 1e-5 * theirs[name].norm(), name
    assert tokens_per_example(lm.data) == 16 and tokens_per_example(SMALL.data) is None


def test_a_polytrain_case_is_timed_from_its_metrics_file(tmp_path):
    case = next(c for c in plan(SMALL, cores=2) if c.key == "single_1t")
    m = run_case(case, SMALL, 0, tmp_path)
    assert m.case == "single_1t" and m.examples_per_sec > 0 and m.window_s > 0
    records = [json.loads(line) for line in (tmp_path / "single_1t-0.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if r["event"] == "step"}
    assert sorted(steps) == [2, 4, 6]  # one record at the end of the warm-up, the last at the end of the window
    assert m.window_s == pytest.approx(steps[6]["time_s"] - steps[2]["time_s"])
    assert m.examples_per_sec == pytest.approx(4 * 4 / m.window_s)


def test_a_metrics_file_without_the_window_is_an_error(tmp_path):
    metrics = tmp_path / "m.jsonl"
    metrics.write_text(json.dumps({"event": "step", "step": 5, "time_s": 1.0, "loss": 1.0}) + "\n")
    case = plan(SMALL, cores=2)[0]
    with pytest.raises(BenchError, match="no step record 10"):
        window_from_metrics(case, 0, metrics, 5, 10)


def test_a_failing_ddp_run_reports_its_error(tmp_path):
    bad = BenchConfig(data="digits", model="mlp:hidden=notanumber", warmup=1, steps=1)
    ddp = next(c for c in plan(bad, cores=2) if c.key == "ddp")
    with pytest.raises(BenchError, match=r"^plain PyTorch DDP, .* failed \(exit code 1\):\n(.|\n)*hidden=notanumber"):
        run_case(ddp, bad, 0, tmp_path)
