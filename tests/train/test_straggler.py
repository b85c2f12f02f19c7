"""--straggler: the chosen rank sleeps (recorded per rank, not timed), random mode repeats, bad specs are one
clear error before anything starts."""

import json

import pytest

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.train.run import check
from polytrain.train.straggler import StragglerInjector


def _records(path):
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if r["event"] == "step"]


def test_the_named_rank_and_only_it_is_slowed(tmp_path):
    metrics = tmp_path / "m.jsonl"
    summary = polytrain.fit(strategy="sync", workers=2, data="digits", model="mlp:hidden=32", batch_size=32,
                            steps=20, log_every=5, eval_every=0, progress="off", straggler=["1:2"],
                            metrics_file=str(metrics))
    records = _records(metrics)
    assert len(records) == 4
    for record in records:
        rank0, rank1 = record["rank_straggler_s"]
        assert rank0 == 0 and rank1 > 0
    assert summary["rank_straggler_s"][0] == 0 and summary["rank_straggler_s"][1] > 0


def test_random_mode_repeats_per_seed_and_rank():
    def slowed_steps(seed, rank):
        injector = StragglerInjector(["random:0.3:2"], rank, seed)
        return [step for step in range(40) if injector.after_step(1e-5) > 0]

    assert slowed_steps(0, 1) == slowed_steps(0, 1)
    assert 0 < len(slowed_steps(0, 1)) < 40
    assert slowed_steps(0, 1) != slowed_steps(0, 0) != slowed_steps(1, 0)


def test_no_stragglers_adds_no_keys(tmp_path):
    injector = StragglerInjector([], 0, 0)
    assert injector.after_step(1.0) == 0.0 and injector.take_metrics() == {}


@pytest.mark.parametrize("specs, message", [
    (["9:2"], r"--straggler 9:2: there is no worker 9 with 2 worker\(s\) \(ranks 0-1\)"),
    (["1:0.5"], r"the factor is how many times slower, so >= 1"),
    (["random:2:3"], r"the probability must be in \(0, 1\]"),
    (["1"], r"expected RANK:FACTOR"),
    (["1:2", "1:3"], r"rank 1 is given twice"),
])
def test_bad_specs_are_one_clear_error_before_start(specs, message):
    with pytest.raises(ConfigError, match=message):
        check(make_config(strategy="sync", workers=2, data="digits", straggler=specs))
