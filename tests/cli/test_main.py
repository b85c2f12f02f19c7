"""The command line as a user meets it: help, errors as one clear line, exit codes (commands that start no
worker through the command's ``main``: in this process, or many lines in one fresh one)."""

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli_batch import run_here, run_many


def test_help_reads_well(capsys):
    top = run_here(capsys, "--help")
    assert top.returncode == 0 and "train" in top.stdout and "devices" in top.stdout
    train = run_here(capsys, "train", "--help")
    full = run_here(capsys, "train", "--help-all")
    assert train.returncode == 0 and full.returncode == 0
    for heading in ("training:", "model:", "data:", "optimizer and learning rate:", "workers and launcher:",
                    "checkpoints:", "logging:", "devices and placement:"):
        assert heading in train.stdout and heading in full.stdout
    common = ("--config", "--strategy", "--device", "--batch-size", "--steps", "--epochs", "--lr-schedule",
              "--log-dir", "--metrics-file", "--save-model", "--checkpoint-dir", "--checkpoint-every",
              "--resume", "--workers", "--seed", "--eval-every", "--optimizer", "--help-all")
    for flag in common:
        assert flag in train.stdout and flag in full.stdout, flag
    for flag in ("--accumulate", "--log-every", "--memory-limit", "--stages", "--tp", "--max-restarts"):
        assert f"  {flag} " not in train.stdout and f"  {flag} " in full.stdout, flag  # --help-all only
    assert "strategy async (parameter servers):" in full.stdout and "strategy async" not in train.stdout
    assert len(train.stdout.splitlines()) * 3 < len(full.stdout.splitlines())  # short: the ~20 most runs set


def test_devices_lists_the_cpu(capsys):
    table = run_here(capsys, "devices")
    assert table.returncode == 0 and "cpu" in table.stdout
    listed = json.loads(run_here(capsys, "devices", "--json").stdout)
    cpu = [d for d in listed if d["name"] == "cpu"]
    assert cpu and cpu[0]["cores"] >= 1


def test_devices_imports_no_strategy_and_on_a_cpu_build_not_torch(cli_env):
    table = subprocess.run([sys.executable, "-X", "importtime", "-m", "polytrain", "devices"], env=cli_env,
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and "cpu" in table.stdout
    imported = {line.rsplit("|", 1)[1].strip() for line in table.stderr.splitlines() if line.startswith("import time:")}
    assert "polytrain.devices.discovery" in imported and "polytrain.components" not in imported
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None and sys.platform != "darwin":
        assert "torch" not in imported  # a CPU build: nothing to ask torch about


def test_print_config_round_trips(capsys, tmp_path):
    first = run_here(capsys, "train", "--print-config", "--lr", "0.125", "--steps", "7")
    assert first.returncode == 0 and "lr = 0.125" in first.stdout
    path = tmp_path / "run.toml"
    path.write_text(first.stdout)
    second = run_here(capsys, "train", "--config", str(path), "--print-config")
    assert second.stdout == first.stdout


BAD_INPUT = [
    (["--model", "resnet9000"], "unknown model 'resnet9000'"),
    (["--data", "imagenet"], "unknown dataset 'imagenet'"),
    (["--strategy", "magic"], "unknown strategy 'magic'"),
    (["--strategy", "synk"], "did you mean 'sync'"),
    (["--data", "cifar10:/nonexistent/cifar"], "/nonexistent/cifar"),
    (["--batch-size", "0"], "--batch-size: must be >= 1, got 0"),
    (["--device", "cuda:3"], "cuda:3"),
    (["--device", "tpu"], "tpu"),
    (["--workers", "0"], "--workers: must be a whole number >= 1"),
    (["--backend", "mpi"], "--backend: unknown value 'mpi'; accepted: auto, gloo, nccl"),
    (["--batch-size", "63", "--workers", "2"], "--batch-size 63 does not divide over 2 workers"),
    (["--workers", "3"], "--batch-size 64 does not divide over 3 workers; pass a multiple of 3 (--batch-size 63 or "
                         "66), or --worker-batch-size B"),  # the default batch: the sizes that fit
    (["--lr-schedule", "exponential:rate=0.1"], "missing decay_steps"),
    (["--nope"], "unrecognized arguments: --nope"),
    # checked before any worker starts: no "[rank 0]" in front
    (["--model", "mlp:foo=1"], "error: --model mlp:foo=1: unknown argument(s) foo; accepted: hidden, activation"),
    # tensor parallel (--tp): the plan checked against the model before anything starts
    (["--strategy", "tp", "--workers", "3", "--tp", "3", "--model", "transformer_lm", "--data", "text"],
     "error: --tp 3 does not divide the 4 attention heads of blocks.0.attn.qkv; use a --tp that divides 4"),
    (["--strategy", "hybrid", "--pp", "2", "--tp", "3", "--model", "transformer_lm", "--data", "text"],
     "error: --tp 3 does not divide the 4 attention heads of blocks.0.attn.qkv"),
    (["--strategy", "tp", "--tp", "2", "--model", "mlp"],
     "error: --tp: --model mlp has no tensor-parallel plan; give one with --tp-plan FILE.toml"),
    (["--strategy", "local-sgd", "--tp", "2", "--model", "transformer_lm", "--data", "text"],
     "error: --strategy local-sgd with --tp 2: not supported (the axes it cuts a replica over: --dp-shard)"),
]


@pytest.fixture(scope="module")
def bad_input_runs(module_cli_env):
    """Every line of BAD_INPUT through the command's main, in one fresh process (one torch import, not 14)."""
    return run_many(module_cli_env, [["train", "--steps", "1", *args] for args, _ in BAD_INPUT])


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[BAD_INPUT[i][1][:40] for i in range(len(BAD_INPUT))])
def test_bad_input_is_one_clear_line(bad_input_runs, case):
    _, message = BAD_INPUT[case]
    proc = bad_input_runs[case]
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert message in lines[0] and "Traceback" not in proc.stderr
