"""`polytrain train` end to end, as a user runs it: the main job, and sync equal to single from the CLI."""

import json
import socket
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli_batch import run_here, run_many


def polytrain(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "polytrain", "train", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def end_event(path):
    events = [json.loads(line) for line in path.read_text().splitlines()]
    return next(e for e in events if e.get("event") == "end")


def test_the_main_job_learns_the_digits(capfd, tmp_path):
    """`make demo` runs plain `polytrain train`: sync on local CPU workers, packaged digits (through the command's
    main in this process: the lines asserted are its own, not its workers')."""
    metrics = tmp_path / "m.jsonl"
    proc = run_here(capfd, "train", "--metrics-file", str(metrics), "--progress", "off")
    assert proc.returncode == 0, proc.stderr
    end = end_event(metrics)
    assert end["eval_accuracy"] >= 0.95
    assert "done:" in proc.stdout and "with sync on 2 worker(s)" in proc.stdout and "per rank" in proc.stdout


def test_sync_on_two_workers_equals_single_from_the_cli(capfd, tmp_path):
    """Both command lines through the command's main, in this process."""
    common = ["--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "64", "--seed", "1",
              "--progress", "off"]
    threads = torch.get_num_threads()
    single = run_here(capfd, "train", "--strategy", "single", "--save-model", str(tmp_path / "single.pt"), *common)
    torch.set_num_threads(threads)  # (single ran in this process)
    sync = run_here(capfd, "train", "--strategy", "sync", "--workers", "2", "--save-model", str(tmp_path / "sync.pt"),
                    *common)
    assert single.returncode == 0 and sync.returncode == 0, single.stderr + sync.stderr
    a = torch.load(tmp_path / "single.pt", weights_only=True)
    b = torch.load(tmp_path / "sync.pt", weights_only=True)
    assert a.keys() == b.keys()
    for name in a:
        rel = (a[name] - b[name]).norm() / a[name].norm().clamp_min(1e-12)
        assert rel <= 1e-5, (name, rel.item())


TOO_SMALL = [
    (["--data", "synthetic:shape=4,size=3", "--workers", "4", "--batch-size", "4"],
     "--workers 4: more workers than training examples (3)"),
    (["--data", "synthetic:shape=4,size=30", "--batch-size", "64"], "larger than the training set (30 examples)"),
]
BAD_SETTINGS = [
    (["--checkpoint-dir", "/proc/forbidden", "--checkpoint-every", "1"],
     "--checkpoint-dir /proc/forbidden: cannot create or write this directory"),
    (["--epochs", "0"], "--epochs: must be >= 1, got 0"),  # with --steps 1: the bad value, not the pair
    (["--lr", "nan"], "--lr: must be a finite number, got nan"),
    (["--momentum", "inf"], "--momentum: must be a finite number, got inf"),
    (["--weight-decay", "nan"], "--weight-decay: must be a finite number, got nan"),
]


@pytest.fixture(scope="module")
def refused(module_cli_env):
    """Every line of TOO_SMALL and BAD_SETTINGS through the command's main, in one fresh process."""
    lines = [["train", "--steps", "1", "--strategy", "sync", *args] for args, _ in TOO_SMALL]
    lines += [["train", "--steps", "1", "--workers", "2", *args] for args, _ in BAD_SETTINGS]
    return run_many(module_cli_env, lines)


@pytest.mark.parametrize("case", range(len(TOO_SMALL)), ids=[m[:30] for _, m in TOO_SMALL])
def test_data_too_small_is_caught_before_launch(refused, case):
    message, proc = TOO_SMALL[case][1], refused[case]
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr


def test_a_taken_master_port_is_one_clear_line(capfd):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run_here(capfd, "train", "--steps", "1", "--workers", "2", "--master-port", str(port))
    assert proc.returncode == 2
    assert f"port {port} on 127.0.0.1 is already in use" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("case", range(len(BAD_SETTINGS)), ids=[m[:30] for _, m in BAD_SETTINGS])
def test_bad_settings_are_one_line_before_any_worker_starts(refused, case):
    message, proc = BAD_SETTINGS[case][1], refused[len(TOO_SMALL) + case]
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert proc.stdout == ""  # a started run prints its opening lines first


def test_tolerate_worker_loss_under_torchrun_is_one_line_before_joining_its_group(cli_env):
    """A torchrun worker's environment, without MASTER_PORT: had it tried to join the group, it would fail
    otherwise (or wait for peers that never come)."""
    # a world of 3: the layout that fills it has 2 workers (worker 1 a helper the job may lose) and 1 server
    env = dict(cli_env, RANK="0", LOCAL_RANK="0", WORLD_SIZE="3", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    proc = polytrain("--strategy", "async", "--tolerate-worker-loss", "--steps", "1", env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and "--tolerate-worker-loss needs polytrain's own launcher: torchrun's agent stops " \
                                   "every worker of a machine when one fails" in lines[0], proc.stderr
