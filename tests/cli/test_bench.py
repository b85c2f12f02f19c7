"""`polytrain bench` as a user runs it: every case runs and the table, JSON and Markdown come out.
Structure only: timing numbers from a 2-step run on a shared machine mean nothing, so none is asserted."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from polytrain.cli.main import main
from tests.helpers.cli_batch import run_here
from tests.helpers.signals import as_from_a_shell, signal_state


def polytrain(*args, env, cwd, timeout=600):
    return subprocess.run([sys.executable, "-m", "polytrain", "bench", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def bench(tmp_path, capsys, monkeypatch, warm_forkserver):
    """``polytrain bench ARGS`` run in ``tmp_path`` through the command's main in this process (a command of its own
    would import torch once more), its workers forked from this process's forkserver (warm_forkserver). Its single
    cases run in this process too: its CPU threads are set back after."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    yield lambda *args: run_here(capsys, "bench", *args)
    torch.set_num_threads(threads)


def test_quick_bench_runs_every_case_and_writes_json_and_markdown(bench, tmp_path):
    proc = bench("--quick", "--markdown", "bench.md")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "polytrain-bench.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["single_1t", "single_all", "sync", "sync_balanced",
                                                   "sync_gloo", "ddp", "no_exchange"]
    assert all(r["examples_per_sec"] > 0 and len(r["runs_examples_per_sec"]) == 1 for r in doc["rows"])
    assert {r["key"] for r in doc["ratios"]} == {
        "sync_vs_ddp", "sync_weak_scaling", "sync_gloo_vs_ddp", "balanced_vs_equal", "sync_balanced_weak_scaling",
        "sync_gloo_weak_scaling", "ddp_weak_scaling", "ceiling_weak_scaling", "sync_vs_ceiling", "sync_vs_single_all"}
    assert doc["config"]["steps"] == 2 and doc["env"]["torch"] == __import__("torch").__version__
    assert "polytrain sync / plain DDP" in proc.stdout and "weak scaling" in proc.stdout
    assert "| plain PyTorch DDP, 2 workers x 1 thread | 2 × 1 |" in (tmp_path / "bench.md").read_text()
    assert "7 runs; the time left follows each" in proc.stdout  # before the first run
    assert re.search(r"^\[1/7\] repeat 1: .*; about \d+ (s|min) left$", proc.stdout, re.M), proc.stdout


def test_a_stopped_bench_says_so_and_nothing_of_checkpoints(cli_env, tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "polytrain", "bench", "--quick"], env=cli_env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_shell)
    seen = []
    for line in proc.stdout:  # the first run done, the second starting
        seen.append(line)
        if line.startswith("[1/7]"):
            break
    state = f"the bench: {signal_state(proc.pid)}; this process: {signal_state(os.getpid())}"  # (in the message: twice in the suite the bench ran on as if never signalled)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (state, err)
    assert err.strip().splitlines()[-1] == ("polytrain: bench stopped by SIGINT after 1 of 7 runs; no results "
                                            "written (a stopped bench keeps no measurement: run it again)")
    assert "checkpoint" not in "".join(seen) + out + err
    assert not (tmp_path / "polytrain-bench.json").exists()


def test_plan_prints_the_cases_without_running(bench, tmp_path):
    proc = bench("--plan", "--workers", "3")
    assert proc.returncode == 0, proc.stderr
    assert "polytrain sync, 3 workers x 1 thread" in proc.stdout and "global batch 192" in proc.stdout
    assert not (tmp_path / "polytrain-bench.json").exists()


def test_bad_settings_exit_with_one_line(bench):
    proc = bench("--workers", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "polytrain: error: --workers must be >= 1, got 0"


@pytest.mark.slow  # single, 2 independent processes, a 2-stage pipeline and its plain twin, each started afresh
def test_quick_pipeline_suite_writes_json_markdown_and_plot(bench, tmp_path):
    proc = bench("--suite", "pipeline", "--quick", "--schedules", "gpipe", "--markdown", "p.md", "--plot", "p.png")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "polytrain-bench-pipeline.json").read_text())
    rows = {row["case"]: row for row in doc["rows"]}
    assert list(rows) == ["single", "ceiling", "gpipe_m2", "plain_gpipe_m2"]  # the pipeline and its plain twin
    single, ceiling, gpipe = rows["single"], rows["ceiling"], rows["gpipe_m2"]
    [ratio] = doc["plain_ratios"]
    assert ratio["case"] == "gpipe_m2" and ratio["min"] <= ratio["value"] <= ratio["max"] and ratio["value"] > 0
    assert ceiling["per_process_vs_single"] > 0 and "efficiency_at_ceiling" in gpipe
    assert gpipe["speedup"] == pytest.approx(gpipe["examples_per_sec"] / single["examples_per_sec"], rel=1e-3)
    assert gpipe["speedup_theoretical"] == round(2 * 2 / 3, 4) and gpipe["bubble_theoretical"] == round(1 / 3, 4)
    assert len(gpipe["rank_busy_s"]) == 2 and all(b > 0 for b in gpipe["rank_busy_s"])
    assert [b["stages"] for b in doc["balance"]] == [2, 4] and all(b["ratio"] >= 1 for b in doc["balance"])
    assert "gpipe, P=2, M=2" in proc.stdout and "--split-at auto, 4 stages" in proc.stdout
    assert "| gpipe, P=2, M=2 |" in (tmp_path / "p.md").read_text()
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_a_flag_the_suite_does_not_read_is_one_line(capsys):
    assert main(["bench", "--suite", "pipeline", "--workers", "3"]) == 2
    assert capsys.readouterr().err.strip() == ("polytrain: error: --workers is not read by --suite pipeline; "
                                               "drop it (see polytrain bench --help)")
    assert main(["bench", "--plot", "p.png"]) == 2
    assert "--plot draws the pipeline suite only" in capsys.readouterr().err


@pytest.mark.slow  # four single runs, two of them compiling a 1-block transformer (20-60 s with a cold cache)
# (a command of its own: what torch.compile starts and keeps stays with the process that compiled)
def test_quick_compile_suite_measures_eager_compiled_and_checkpointed_in_one_run(cli_env, tmp_path):
    proc = polytrain("--suite", "compile", "--quick", "--markdown", "c.md", env=cli_env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "polytrain-bench-compile.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["eager", "compiled", "checkpointed", "compiled_checkpointed"]
    assert all(r["examples_per_sec"] > 0 and len(r["runs_examples_per_sec"]) == 1 for r in doc["rows"])
    losses = [r["final_loss"] for r in doc["rows"]]
    assert max(losses) - min(losses) <= 1e-4 * abs(losses[0])  # the same steps, whatever the unit options
    ratios = {r["key"]: r for r in doc["ratios"]}
    assert set(ratios) == {"compiled_vs_eager", "checkpointed_vs_eager", "compiled_checkpointed_vs_checkpointed"}
    rows = {r["case"]: r for r in doc["rows"]}
    assert ratios["compiled_vs_eager"]["value"] == pytest.approx(
        rows["compiled"]["examples_per_sec"] / rows["eager"]["examples_per_sec"], rel=1e-3)
    assert "speed --compile / eager" in proc.stdout
    assert "| --compile --activation-checkpointing full |" in (tmp_path / "c.md").read_text()


def test_compile_suite_plan_and_its_flags(bench, tmp_path, capsys):
    proc = bench("--suite", "compile", "--plan", "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    assert "3 warm-up + 5 timed steps" in proc.stdout and "  --compile --activation-checkpointing full" in proc.stdout
    assert not (tmp_path / "polytrain-bench-compile.json").exists()
    assert main(["bench", "--suite", "compile", "--workers", "2"]) == 2
    assert capsys.readouterr().err.strip() == ("polytrain: error: --workers is not read by --suite compile; "
                                               "drop it (see polytrain bench --help)")
    assert main(["bench", "--suite", "compile", "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip() == "polytrain: error: --steps must be >= 1, got 0"
