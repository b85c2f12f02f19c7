"""--profile A-B: a Chrome trace per trainer rank with the step's phases labelled, and a summary whose phases
account for the step time each rank measured."""

import json

import pytest

import polytrain
from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.phases import PHASES

# a step of some milliseconds, so that the labels' own cost is small beside it
RUN = dict(data="digits", model="mlp:hidden=1024x1024", batch_size=256, progress="off", eval_every=0, log_every=2)


def test_sync_traces_every_rank_and_its_phases_add_up_to_the_measured_step(tmp_path):
    out = tmp_path / "profile"
    polytrain.fit(strategy="sync", workers=2, steps=7, profile="4-6", profile_dir=str(out), **RUN)
    ranks = json.loads((out / "summary.json").read_text())
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for entry in ranks:
        trace = json.loads((out / f"rank-{entry['rank']}.pt.trace.json").read_text())  # valid JSON
        events = trace["traceEvents"]
        names = {e.get("name") for e in events if e.get("ph") == "X"}
        assert {f"polytrain.step {n}" for n in (4, 5, 6)} <= names, entry["rank"]
        assert {"polytrain.data", "polytrain.forward", "polytrain.backward", "polytrain.exchange",
                "polytrain.update"} <= names, entry["rank"]
        assert sum(1 for e in events if e.get("cat") == "cpu_op") > 50  # the operators the phases hold
        assert [s["step"] for s in entry["steps"]] == [4, 5, 6]
        for step in entry["steps"]:
            assert set(step["phases"]) <= set(PHASES)
            # the phases lie inside the step the trainer timed, and leave little of it unlabelled
            assert sum(step["phases"].values()) <= step["step_s"] * 1.001, step
        labelled = sum(sum(s["phases"].values()) for s in entry["steps"])
        measured = sum(s["step_s"] for s in entry["steps"])
        assert labelled >= 0.9 * measured, (entry["rank"], labelled, measured)
        assert all(step["phases"]["exchange"] > 0 for step in entry["steps"])  # DDP's gradients averaged
    table = (out / "summary.txt").read_text().splitlines()
    assert table[1].split()[:2] == ["rank", "step"] and [row.split()[0] for row in table[2:]] == ["0", "1"]


def test_profile_windows_that_cannot_be_traced_are_one_line():
    for text, message in (("5-3", "--profile: '5-3': expected 1 <= A <= B, got A=5, B=3"),
                          ("0", "--profile: '0': expected 1 <= A <= B, got A=0, B=0"),
                          ("20:25", "--profile: '20:25': expected steps A-B (e.g. 20-25) or one step N, counted "
                                    "from 1")):
        with pytest.raises(ConfigError) as info:
            make_config(profile=text)
        assert str(info.value) == message
    with pytest.raises(ConfigError, match=r"^--profile 5-6: this run trains steps 1-3; give steps within them$"):
        polytrain.fit(strategy="single", steps=3, profile="5-6", **RUN)
