import json
import os
import signal
import time

import pytest
import torch

import polytrain
import polytrain.models
from polytrain.errors import DivergedError
from polytrain.train.checkpoint import Checkpointer
from tests.helpers.cli_batch import run_here

BASE = dict(data="digits", model="mlp:hidden=32", batch_size=32, progress="off", log_every=1, eval_every=0)


def _records(path, event="step"):
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if r["event"] == event]


def _losses(path):
    return {r["step"]: r["loss"] for r in _records(path)}


def test_same_seed_same_trajectory_other_seed_another(tmp_path):
    summaries = [polytrain.fit(strategy="single", steps=15, seed=seed, metrics_file=str(tmp_path / f"{name}.jsonl"),
                               **BASE) for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    a, b, c = (_losses(tmp_path / f"{n}.jsonl") for n in "abc")
    assert a == b and len(a) == 15
    assert a != c
    # the rates: steady after the first 5 steps (reported apart), the start-up from fit() to the first step
    summary, records = summaries[0], _records(tmp_path / "a.jsonl")
    assert summary["warmup_steps"] == 5 and summary["warmup_s"] > 0 and summary["warmup_examples_per_sec"] > 0
    assert summary["examples_per_sec"] > 0 and summary["startup_s"] >= 0
    assert all(r["eta_s"] >= 0 for r in records) and records[-1]["eta_s"] == 0
    assert [r["time_s"] for r in records] == sorted(r["time_s"] for r in records)


@pytest.mark.parametrize("strategy, workers", [("single", 1), ("sync", 2)])
def test_resume_continues_the_exact_trajectory(tmp_path, strategy, workers):
    common = dict(BASE, strategy=strategy, workers=workers, lr_schedule="exponential:rate=0.5,decay_steps=10",
                  optimizer="adam", lr=0.01)
    polytrain.fit(steps=30, metrics_file=str(tmp_path / "whole.jsonl"), **common)
    ckpt = str(tmp_path / "ckpt")
    polytrain.fit(steps=12, checkpoint_dir=ckpt, checkpoint_every=5, metrics_file=str(tmp_path / "part1.jsonl"),
                  **common)
    summary = polytrain.fit(steps=30, checkpoint_dir=ckpt, resume=True,
                            metrics_file=str(tmp_path / "part2.jsonl"), **common)
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "part2.jsonl")
    assert sorted(resumed) == list(range(13, 31))  # continued after the step-12 checkpoint
    assert all(resumed[s] == whole[s] for s in resumed), "bitwise equal losses after the resume point"
    assert summary["steps"] == 30


KILLABLE = ["train", "--strategy", "single", "--data", "synthetic:shape=3x24x24,size=2048", "--model", "cifar_cnn",
            "--batch-size", "32",
            "--lr-schedule", "exponential:rate=0.5,decay_steps=40", "--log-every", "1", "--progress", "off",
            "--eval-every", "0", "--checkpoint-every", "5", "--seed", "5",
            "--threads-per-worker", "1"]  # the killed run's process and the test's (tests/conftest.py) alike: the
#                                           same sums, so the resumed run is bit for bit the whole one


def _train_until_killed(argv):
    from polytrain.cli.main import main

    main(argv)


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, capsys):
    # The killed run has more steps than it can reach, so the kill always lands mid-run however slowly this
    # test polls; the schedule does not depend on --steps, so the later runs may stop 15 steps after
    # whichever checkpoint the kill left. It is a process of its own, forked from this process's forkserver
    # (torch imported, nothing run: no fresh import of torch), that runs the command's main.
    from polytrain.distributed.processes import start_context

    ckpt = tmp_path / "ckpt"
    run = start_context().Process(target=_train_until_killed, args=(
        [*KILLABLE, "--steps", "100000", "--checkpoint-dir", str(ckpt), "--metrics-file",
         str(tmp_path / "killed.jsonl")],))
    run.start()
    deadline = time.monotonic() + 300  # a hang guard only
    while not (ckpt / "latest").exists():
        assert run.is_alive() and time.monotonic() < deadline, run.exitcode
        time.sleep(0.02)
    os.kill(run.pid, signal.SIGKILL)
    run.join()
    assert run.exitcode == -signal.SIGKILL
    left = Checkpointer(ckpt).latest().name  # step-00000005.pt: the resume loads it, this test only counts
    end = int(left[len("step-"):-len(".pt")]) + 15
    # the resumed and the whole run: single trains in the command's own process, so its main runs them here
    for args in (["--checkpoint-dir", str(ckpt), "--resume", "--metrics-file", str(tmp_path / "resumed.jsonl")],
                 ["--metrics-file", str(tmp_path / "whole.jsonl")]):
        done = run_here(capsys, *KILLABLE, "--steps", str(end), *args)
        assert done.returncode == 0, done.stderr
    whole, resumed = _losses(tmp_path / "whole.jsonl"), _losses(tmp_path / "resumed.jsonl")
    assert sorted(resumed) == list(range(end - 14, end + 1))
    assert all(resumed[s] == whole[s] for s in resumed)


def test_nan_guard_stops_with_exit_code_and_step(tmp_path, capsys):
    """The command's main in this process (single trains in the command's own process)."""
    metrics = tmp_path / "m.jsonl"
    proc = run_here(capsys, "train", "--strategy", "single", "--model", "mlp", "--lr", "1e12", "--steps", "50",
                    "--log-every", "1", "--progress", "lines", "--metrics-file", str(metrics))
    assert proc.returncode == 3
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("polytrain: error: model diverged at step ")
    step = int(last.split("step ")[1].split(":")[0])
    logged = _records(metrics)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in logged)
    assert [r["step"] for r in logged] == list(range(1, step))  # every step before the bad one, none after
    assert "Traceback" not in proc.stderr and not _records(metrics, "end")


def test_diverged_error_in_sync_workers_is_reported_once(tmp_path):
    with pytest.raises(DivergedError, match=r"model diverged at step \d+"):
        polytrain.fit(strategy="sync", workers=2, steps=50, lr=1e12, **dict(BASE, model="mlp"))


def test_a_nan_seen_by_one_worker_stops_the_job_naming_that_rank_and_step(tmp_path):
    """The loss is checked on each rank without a collective; the rank whose slice holds a NaN stops the job."""
    from polytrain.data.base import DataBundle, TensorData
    from polytrain.data.batches import BatchPlan

    inputs, targets = torch.randn(256, 20), torch.randint(0, 3, (256,))
    bad = 77
    inputs[bad, 0] = float("nan")
    data = DataBundle("poisoned", TensorData(inputs, targets), None, (20,), 3)
    plan = BatchPlan(256, 32, seed=5)
    step = next(k for k in range(plan.steps_per_epoch) if bad in plan.global_indices(k).tolist())
    rank = plan.global_indices(step).tolist().index(bad) // 16
    with pytest.raises(DivergedError, match=rf"^\[rank {rank}\] model diverged at step {step + 1}:"):
        polytrain.fit(model="mlp:hidden=8", data=data, strategy="sync", workers=2, batch_size=32, seed=5,
                      steps=plan.steps_per_epoch, progress="off", eval_every=0)


def test_metrics_file_contract_and_saved_model(tmp_path):
    metrics, weights = tmp_path / "m.jsonl", tmp_path / "model.pt"
    summary = polytrain.fit(strategy="single", steps=20, metrics_file=str(metrics), save_model=str(weights),
                            **dict(BASE, log_every=5))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert lines[0]["event"] == "start" and lines[0]["config"]["steps"] == 20
    steps = [r for r in lines if r["event"] == "step"]
    assert [r["step"] for r in steps] == [5, 10, 15, 20]
    for r in steps:
        assert {"step", "loss", "lr", "examples_per_sec", "sec_per_batch", "time_s"} <= set(r)
        assert r["examples_per_sec"] > 0 and r["sec_per_batch"] > 0
    times = [r["time_s"] for r in steps]
    assert times == sorted(times) and times[0] > 0 and times[-1] <= summary["wall_s"]
    end = lines[-1]
    assert end["event"] == "end"
    assert {"steps", "train_loss", "eval_loss", "eval_accuracy", "wall_s"} <= set(end)
    assert end["steps"] == 20 and 0 <= end["eval_accuracy"] <= 1 and end["wall_s"] > 0
    assert end == {"event": "end", **summary}

    state = torch.load(weights, weights_only=True)
    model = polytrain.models.mlp(input_shape=(1, 8, 8), num_classes=10, hidden=32)
    model.load_state_dict(state)  # plain state_dict, no wrapper prefixes


def test_tensorboard_scalars_histograms_and_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    polytrain.fit(strategy="single", steps=10, log_dir=str(logdir), histogram_every=5,
                  **dict(BASE, log_every=5, eval_every=5))
    events = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    events.Reload()
    tags = events.Tags()
    assert {"train/loss", "train/lr", "perf/examples_per_sec", "perf/sec_per_batch", "eval/loss",
            "eval/accuracy"} <= set(tags["scalars"])
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10]
    assert any(t.startswith("weights/") for t in tags["histograms"])
    assert any(t.startswith("grads/") for t in tags["histograms"])
    saved = (logdir / "config.toml").read_text()
    assert "steps = 10" in saved and 'strategy = "single"' in saved
