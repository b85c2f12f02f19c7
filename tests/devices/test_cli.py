"""The device flags end to end, from the command line: fallbacks, one-line errors, the placement log."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli_batch import run_many

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
# mlp:hidden=16 is Sequential(0 Flatten, 1 Linear, 2 ReLU, 3 Linear)
RUN = ["train", "--strategy", "single", "--data", "digits", "--model", "mlp:hidden=16", "--steps", "3",
       "--progress", "lines", "--eval-every", "0"]


def polytrain(env, *args):
    return subprocess.run([sys.executable, "-m", "polytrain", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def _one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@NO_CUDA
def test_soft_placement_from_the_cli_trains_on_the_cpu_and_logs_everything(cli_env, tmp_path):
    logs = tmp_path / "logs"
    proc = polytrain(cli_env, *RUN, "--place", "1=cuda:1", "--soft-placement", "--log-placement",
                     "--log-dir", str(logs))
    assert proc.returncode == 0, proc.stderr
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: soft placement")]
    assert len(warnings) == 1 and "device 'cuda:1' is not available" in warnings[0] and "using cpu" in warnings[0]
    assert "placement of UnitSequential (rank 0)" in proc.stdout
    assert "operators of step 0 and their devices (rank 0)" in proc.stdout
    assert "done: 3 steps" in proc.stdout
    ops = (logs / "placement-ops-rank0-step0.txt").read_text()
    assert "aten.addmm.default" in ops and "cuda" not in ops
    assert (logs / "placement-rank0.txt").exists()


MISSING = [
    (["--place", "1=cuda:1"], "polytrain: error: --place (1=cuda:1): device 'cuda:1' is not available"),
    (["--device", "cuda"], "polytrain: error: --device: device 'cuda:0' (from 'cuda') is not available"),
    (["--device", "/gpu:0"], "polytrain: error: --device: device 'cuda:0' (from '/gpu:0') is not available"),
]
BAD = [
    (["--place", "head=cpu"], "--place: 'head' matches no module of the model; module names: 0, 1, 2, 3;"),
    (["--place", "1"], "--place: '1' is not MODULE=DEVICE"),
    (["--device", "gpu1"], "--device: bad device 'gpu1'"),
    (["--strategy", "sync", "--device", "cpu:3", "--workers", "4"],
     "--workers 4 and --device cpu:3 (3 workers) disagree"),
]


@pytest.fixture(scope="module")
def bad_runs(module_cli_env):
    """Every line of MISSING and BAD through the command's main, in one fresh process."""
    return run_many(module_cli_env, [[*RUN, *args] for args, _ in MISSING + BAD])


@NO_CUDA
@pytest.mark.parametrize("case", range(len(MISSING)), ids=[" ".join(a) for a, _ in MISSING])
def test_without_soft_placement_a_missing_device_is_one_error_line(bad_runs, case):
    line = _one_error_line(bad_runs[case])
    assert line.startswith(MISSING[case][1])
    assert "available devices: cpu;" in line and "--soft-placement" in line


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(a) for a, _ in BAD])
def test_bad_device_flags_are_one_error_line(bad_runs, case):
    assert BAD[case][1] in _one_error_line(bad_runs[len(MISSING) + case])


@NO_CUDA
def test_soft_device_fallback_for_the_whole_run(cli_env, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = polytrain(cli_env, *RUN, "--device", "cuda", "--soft-placement", "--metrics-file", str(metrics))
    assert proc.returncode == 0, proc.stderr
    assert "warning: soft placement: device 'cuda:0' is not available" in proc.stdout
    assert "strategy single: 1 process on cpu" in proc.stdout
    assert json.loads(metrics.read_text().splitlines()[-1])["steps"] == 3

