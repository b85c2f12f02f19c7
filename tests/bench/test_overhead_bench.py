"""``polytrain bench --suite overhead`` in its smallest form: one row (single on the tiny mlp), one repeat of a
few steps. Its numbers are measured, not tested; the report's shape and the steps both sides trained are."""

import pytest

from polytrain.bench.overhead import OverheadBenchConfig, format_markdown, format_text, run_suite
from polytrain.errors import ConfigError


@pytest.fixture(scope="module")
def doc():
    return run_suite(OverheadBenchConfig(cases=("single-mlp",), warmup=2, steps=4, repeats=1))


def test_both_sides_train_the_same_steps(doc):
    (row,) = doc["rows"]
    assert row["key"] == "single-mlp"
    assert row["polytrain_steps"] == row["plain_steps"] == [6]
    # the same model, initial values and batches: the same losses over the last log interval
    assert row["polytrain_final_loss"] == pytest.approx(row["plain_final_loss"], rel=1e-5)
    assert row["polytrain_ms"] > 0 and row["plain_ms"] > 0 and row["ratio"] > 0
    assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"] and row["load_min"] <= row["load"] <= row["load_max"]
    assert row["target"] == 0.97 and row["met"] == (row["ratio"] >= 0.97)


def test_the_report_and_the_profile(doc):
    profile = doc["profile"]
    assert profile["row"] == "single-mlp" and profile["steps"] == 4
    assert set(profile["parts_us"]) <= {"phases", "NaN guard", "metrics", "stop check", "heartbeat", "memory meter",
                                        "loss reduction", "log points", "data", "lr schedule", "strategy step",
                                        "loop", "device runtime", "other"}
    assert all(f["function"].startswith("polytrain/") for f in profile["functions_us"])
    text = format_text(doc)
    for words in ("single-mlp", "ratio (min-max)", "load (min-max)", "single / plain loop on the tiny mlp",
                  "polytrain's own time in a single-mlp step"):
        assert words in text
    assert format_markdown(doc).count("| single-mlp |") == 1


def test_what_the_suite_refuses():
    for settings, message in ((dict(steps=5, warmup=2), "--steps 5 is not a multiple of --warmup 2"),
                              (dict(cases=("single", "tp")), "--cases single: no such row of --suite overhead"),
                              (dict(repeats=0), "--repeats must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            OverheadBenchConfig(**settings).check()
