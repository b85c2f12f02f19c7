"""benchmarks/mfu.py: model FLOPs utilisation on a GPU against a plain loop (run by tools/gpu_check.sh)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import mfu  # noqa: E402


def test_the_peak_is_the_cards_own_and_the_pcie_part_is_not_taken_for_the_sxm_one():
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.4
    assert mfu.peak_tflops("NVIDIA H100 PCIe", None) == 756.5
    assert mfu.peak_tflops("NVIDIA GeForce GTX 1080", None) is None
    assert mfu.peak_tflops("NVIDIA GeForce GTX 1080", 8.9) == 8.9


@pytest.mark.gpu
def test_a_small_run_reports_both_sides_over_the_same_counted_flops(tmp_path, cli_env):
    out = tmp_path / "mfu.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mfu.py"), "--model",
                           "transformer_lm:layers=1,dim=64,heads=2", "--seq-len", "32", "--batch-size", "4",
                           "--steps", "12", "--warmup", "2", "--no-compile", "--out", str(out)],
                          env=cli_env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["flops_per_step"] > 6 * 64 * 64 * 4 * 32  # at least the block's matrix products
    assert len(result["plain_steps_per_s"]) == 2 and result["polytrain_steps_per_s"] > 0
    assert result["polytrain_mfu"] == pytest.approx(result["polytrain_tflops"] / result["peak_tflops"], abs=1e-3)
