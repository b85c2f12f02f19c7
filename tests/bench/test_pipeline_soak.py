"""The soak suite: the configurations of the parity tests, and a run that overstays its limit is killed
with its workers and reported hung."""

import os
import time

import pytest

from polytrain.bench.pipeline_soak import SoakConfig, format_text, run_one, soak_cases
from polytrain.errors import ConfigError


def test_every_configuration_of_the_parity_tests_and_hybrid():
    chosen, skipped = soak_cases(SoakConfig(schedules=("gpipe", "1f1b", "zbv")))
    labels = [c.label for c in chosen]
    assert labels == [f"pipeline {s} P={p} M={m}" for p in (2, 4) for s in ("gpipe", "1f1b", "zbv")
                      for m in (p, 2 * p)] + ["hybrid dp=2 x pp=2 1f1b M=2"]
    assert skipped == []
    assert chosen[-1].args[:2] == ("--strategy", "hybrid") and "--workers" in chosen[-1].args


def test_a_run_that_ends_is_ok_and_one_past_its_limit_is_killed_as_hung(tmp_path):
    case = next(c for c in soak_cases(SoakConfig(schedules=("gpipe",)))[0] if c.label == "pipeline gpipe P=2 M=2")
    ok = run_one(case, SoakConfig(steps=2, timeout=120), tmp_path)
    assert (ok["outcome"], ok["steps"], ok["exit_code"]) == ("ok", 2, 0)
    hung = run_one(case, SoakConfig(steps=100000, timeout=1.5), tmp_path)
    # killed at its limit: it ran at least that long, and its group is gone (the 100000 steps would take hours)
    assert hung["outcome"] == "hung" and hung["seconds"] >= 1.5
    assert _group_ends(hung["pid"])  # the launcher and its stage workers are gone with it
    text = format_text({"config": SoakConfig(steps=2).to_dict(), "env": {"torch": "x", "date": "d"},
                        "rows": [ok, hung], "skipped": []})
    assert "pipeline gpipe P=2 M=2" in text and "hung" in text and "1 of 2 configurations ran every step" in text


def _group_ends(pgid, within=10.0):
    """Whether no process of group ``pgid`` is left within ``within`` seconds (killed workers are reaped
    by whoever inherits them, which takes a moment)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("settings", [dict(steps=0), dict(batch_size=0), dict(timeout=0)])
def test_settings_that_are_not_positive_are_one_line(settings):
    with pytest.raises(ConfigError, match="^--steps, --batch-size and --timeout must be positive$"):
        SoakConfig(**settings).check()
