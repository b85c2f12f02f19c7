"""The goodput suite's pieces that need no long job: its settings, the kill schedule, reading progress from a
metrics file and finding a job's workers. The suite itself runs jobs for minutes: benchmarks/results holds its
measurements (docs/fault-tolerance.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from polytrain.bench.goodput import GoodputBenchConfig, command, last_step, parse_seconds, workers_of
from polytrain.errors import ConfigError


def test_seconds_are_read_with_or_without_a_unit():
    assert parse_seconds("60s") == parse_seconds("60") == parse_seconds("1m") == 60.0
    with pytest.raises(ConfigError, match="expected seconds such as 60, 60s or 2m, got 'soon'"):
        parse_seconds("soon")


def test_kills_fall_strictly_inside_the_duration():
    assert GoodputBenchConfig(duration=600, failure_every=60).kills == 9
    assert GoodputBenchConfig(duration=610, failure_every=60).kills == 10


@pytest.mark.parametrize("settings, message", [
    ({"workers": 1}, "--workers must be >= 2"),
    ({"failure_every": 700}, "no failure would fall within --duration 600s"),
    ({"sides": ("undisturbed", "sometimes")}, "unknown side"),
])
def test_settings_that_cannot_measure_are_refused(settings, message):
    with pytest.raises(ConfigError, match=message):
        GoodputBenchConfig(**settings).check()


def test_only_the_failing_jobs_checkpoint_or_continue(tmp_path):
    cfg = GoodputBenchConfig()
    assert "--checkpoint-dir" not in command(cfg, "undisturbed", tmp_path)
    restart = command(cfg, "max-restarts", tmp_path)
    assert restart[restart.index("--checkpoint-every-seconds") + 1] == "30"
    assert int(restart[restart.index("--max-restarts") + 1]) >= cfg.kills
    going_on = command(cfg, "continue", tmp_path)
    assert going_on[going_on.index("--on-failure") + 1] == "continue" and "--checkpoint-dir" not in going_on
    assert int(going_on[going_on.index("--max-restarts") + 1]) >= cfg.kills  # replacements join
    assert all(command(cfg, side, tmp_path).count("--comm") == 1 for side in ("undisturbed", "max-restarts", "continue"))


def test_progress_is_the_last_step_record_even_after_a_restart_went_back(tmp_path):
    metrics = tmp_path / "m.jsonl"
    assert last_step(metrics) == 0
    records = [{"event": "start", "step": 0}] + [{"event": "step", "step": s} for s in (1, 2, 3, 4)]
    records += [{"event": "restart", "restart": 1}, {"event": "step", "step": 3}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert last_step(metrics) == 3


def test_workers_are_found_by_their_process_name():
    code = ("import ctypes, time; ctypes.CDLL('libc.so.6').prctl(15, b'polytrain-r3'); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 10
        while workers_of(os.getpid()) != {3: child.pid}:
            assert time.monotonic() < deadline, workers_of(os.getpid())
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    assert workers_of(os.getpid()) == {}


def test_the_table_gives_each_jobs_median_and_spread_of_what_a_failure_cost():
    from polytrain.bench.goodput import format_text

    recoveries = [{"event": "recovery", "restart": n, "first_step_s": first, "back_s": back, "redone_steps": redone}
                  for n, (first, back, redone) in enumerate([(1.5, 2.5, 8), (2.0, 4.0, 15), (1.0, 2.0, 4)], 1)]
    job = dict(side="max-restarts", useful_steps=900, useful_steps_per_s=9.0, goodput=0.9, target=0.85, kills=[{}] * 3,
               restarts=3, lost_s=8.5, goodput_by_lost_time=0.92, load_1min_before=3.0, load_1min_after=4.0,
               recoveries=recoveries)
    doc = {"config": {"duration": 100, "failure_every": 30, "workers": 4}, "machine": {"cpus": 2}, "date": "today",
           "results": [job], "skipped": {}}
    row = next(line for line in format_text(doc).splitlines() if line.startswith("| max-restarts"))
    assert "| 2.5 (2.0-4.0) | 1.5 (1.0-2.0) | 8 (4-15) | 3.0 -> 4.0 |" in row
    # --jobs without the undisturbed one: no goodput to give, the rest of the row as it was
    alone = dict(doc, results=[dict(job, goodput=None)])
    row = next(line for line in format_text(alone).splitlines() if line.startswith("| max-restarts"))
    assert "| - (no undisturbed job) |" in row and "| 8 (4-15) | 3.0 -> 4.0 |" in row


def test_a_kill_the_job_never_came_back_from_is_lost_until_the_next_kill_or_the_end():
    from polytrain.bench.goodput import lost_time

    kills = [{"at_s": 60.0, "back_after_s": 1.0}, {"at_s": 120.0, "back_after_s": None}, {"at_s": 180.0}]
    job = dict(kills=kills, wall_s=300.0, progress=[(0.0, 0), (10.0, 5)])
    lost_time(job)
    assert job["lost_s"] == 1.0 + 60.0 + 120.0 and job["goodput_by_lost_time"] == round(1 - 181.0 / 290.0, 4)
