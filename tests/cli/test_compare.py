"""polytrain compare: spec parsing, checks before anything trains, and one small real comparison end to end."""

import json
import re

import pytest

from polytrain.cli.main import main
from polytrain.compare import available, parse_spec, parse_specs
from polytrain.errors import ConfigError


def test_specs_parse_names_settings_and_module_paths():
    assert parse_spec("async").name == "async"  # parsed whether or not it is registered here
    spec = parse_spec("async:staleness=2")
    assert (spec.name, spec.settings) == ("async", {"staleness": "2"})
    spec = parse_spec("diloco:sync-every=8:outer_lr=0.5")
    assert (spec.name, spec.settings) == ("diloco", {"sync_every": "8", "outer_lr": "0.5"})
    spec = parse_spec("my.pkg.mod:Fancy:sync_every=4")
    assert (spec.name, spec.settings) == ("my.pkg.mod:Fancy", {"sync_every": "4"})
    assert [s.text for s in parse_specs("sync, local-sgd:sync_every=8,")] == ["sync", "local-sgd:sync_every=8"]


@pytest.mark.parametrize("text, message", [
    ("sync,sync", "given twice"),
    ("local-sgd:sync_every=", "expected KEY=VALUE"),
    ("sync:workers=4", "workers is shared by every case"),
    ("", "at least one strategy"),
    ("sync::x=1", r"^--strategies: 'sync::x=1': expected NAME or NAME:KEY=VALUE\[:KEY=VALUE...\] "
                  r"\(e.g. local-sgd:sync_every=8\)$"),
])
def test_bad_specs_are_one_clear_error(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_specs(text)


def test_a_missing_strategy_is_skipped_from_the_defaults_but_an_error_when_named():
    specs = parse_specs("sync,surely-not-registered:x=1")
    kept, notes = available(specs, named_by_user=False)
    assert [s.name for s in kept] == ["sync"] and "surely-not-registered" in notes[0]
    with pytest.raises(ConfigError, match="unknown strategy 'surely-not-registered'"):
        available(specs, named_by_user=True)


def test_every_case_is_checked_before_any_trains(tmp_path, capsys):
    code = main(["compare", "--strategies", "sync,local-sgd:sync_every=0", "--out", str(tmp_path), "--no-plot"])
    assert code != 0
    expected = "polytrain: error: case local-sgd:sync_every=0: --sync-every: must be >= 1, got 0\n"
    assert capsys.readouterr().err == expected
    assert not (tmp_path / "runs").exists(), "nothing trained"


@pytest.mark.slow  # four runs, each spawning 2 workers
def test_compare_runs_every_case_with_and_without_a_straggler(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    code = main(["compare", "--strategies", "sync,diloco:sync_every=2", "--straggler", "1:2", "--steps", "10",
                 "--eval-every", "10", "--log-every", "5", "--model", "mlp:hidden=16", "--set", "comm=backend",
                 "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "compare.json").read_text())
    cases = [row["case"] for row in doc["rows"]]
    assert cases == ["sync", "diloco:sync_every=2", "sync +straggler 1:2", "diloco:sync_every=2 +straggler 1:2"]
    rows = {row["case"]: row for row in doc["rows"]}
    # ring model, same payload: diloco exchanges parameters every 2 steps, sync gradients every step
    assert rows["diloco:sync_every=2"]["fewer_bytes_than_sync"] == 2.0
    assert rows["diloco:sync_every=2 +straggler 1:2"]["fewer_bytes_than_sync"] == 2.0
    slept = rows["sync +straggler 1:2"]["rank_straggler_s"]
    assert slept[0] == 0 and slept[1] > 0
    assert all(len(doc["curves"][case]["loss"]) == 2 for case in cases)
    assert (out / "compare.png").stat().st_size > 0
    assert "| case | examples/s |" in (out / "compare.md").read_text()
    printed = capsys.readouterr().out
    assert "diloco:sync_every=2 +straggler 1:2" in printed
    accuracies = re.findall(r"eval accuracy (\S+), ", printed)  # each run's line: 4 places, not 16
    assert len(accuracies) == 4 and all(re.fullmatch(r"\d\.\d{4}", a) for a in accuracies), accuracies


def test_repeated_rounds_give_medians_and_each_ratio_is_taken_within_its_round():
    from polytrain.compare import rows
    from polytrain.compare.runner import Outcome
    from polytrain.compare.specs import CompareConfig

    def run(label, strategy, seconds, round_, accuracy):  # 1000 examples in `seconds`
        summary = {"eval_accuracy": accuracy, "bytes_sent_per_example": 100 if strategy == "sync" else 50}
        return Outcome(label, strategy, [], summary, curve=[(seconds, 1000, 0.1)], round=round_)

    # round 2 ran on a machine twice as slow: the ratios within each round stay 2.0 and 1.0
    outcomes = [run("sync", "sync", 1.0, 0, 0.9), run("async", "async", 0.5, 0, 0.8),
                run("sync", "sync", 2.0, 1, 0.9), run("async", "async", 2.0, 1, 0.9),
                run("sync", "sync", 1.0, 2, 0.9), run("async", "async", 0.5, 2, 0.8)]
    table = {r["case"]: r for r in rows(CompareConfig(repeats=3), outcomes)}
    assert table["sync"]["examples_per_sec"] == 1000 and table["sync"]["rounds"] == 3
    assert table["sync"]["examples_per_sec_range"] == [500, 1000]
    assert table["async"]["speed_vs_sync"] == 2.0 and table["async"]["speed_vs_sync_range"] == [1.0, 2.0]
    assert table["async"]["fewer_bytes_than_sync"] == 2.0 and table["async"]["accuracy_vs_sync_points"] == -10.0


@pytest.mark.parametrize("settings, message", [
    (dict(repeats=0), "--repeats must be >= 1, got 0"),
    (dict(log_every=0), "--log-every must be >= 1, got 0"),
    (dict(eval_every=15, log_every=10), "--eval-every 15 must be a multiple of --log-every 10"),
    (dict(target_accuracy=1.5), r"--target-accuracy must be in \(0, 1\], got 1.5"),
])
def test_bad_settings_are_one_line(settings, message):
    from polytrain.compare.specs import CompareConfig

    with pytest.raises(ConfigError, match=f"^{message}$"):
        CompareConfig(**settings).check()


def test_a_malformed_set_is_one_line(tmp_path, capsys):
    assert main(["compare", "--set", "comm", "--out", str(tmp_path), "--no-plot"]) == 2
    assert capsys.readouterr().err == "polytrain: error: --set: expected key=value, got 'comm'\n"
    assert not (tmp_path / "runs").exists()


def test_a_shared_setting_of_one_strategy_goes_to_its_cases_only():
    """``--set comm=backend`` is sync's: every other case would refuse it (a setting it does not read)."""
    from polytrain.compare.specs import CompareConfig

    cfg = CompareConfig(extra={"comm": "backend", "staleness": "2", "threads-per-worker": "1"})
    shared = {name: {k: v for k, v in cfg.settings(parse_spec(name), []).items() if k in cfg.extra}
              for name in ("sync", "async", "diloco")}
    assert shared == {"sync": {"comm": "backend", "threads-per-worker": "1"},
                      "async": {"staleness": "2", "threads-per-worker": "1"},
                      "diloco": {"threads-per-worker": "1"}}
    assert cfg.settings(parse_spec("async:staleness=0"), [])["staleness"] == "0"  # the case's own wins
