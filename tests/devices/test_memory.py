"""--gpu-memory-fraction: validation, the CPU note, and the real cap on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from polytrain.devices.discovery import cuda_device_count
from polytrain.devices.memory import check_memory_fraction, set_gpu_memory_fraction
from polytrain.errors import DeviceError

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")


@pytest.mark.parametrize("value,expected", [(0.5, 0.5), (1, 1.0), (1e-3, 1e-3)])
def test_valid_fractions(value, expected):
    assert check_memory_fraction(value) == expected and isinstance(check_memory_fraction(value), float)


@pytest.mark.parametrize("value,message", [
    (0, r"must be in \(0, 1\]"), (-0.5, r"must be in \(0, 1\]"), (1.5, r"got 1.5"),
    (float("nan"), "must be a number"), (True, "must be a number"), ("0.5", "must be a number"),
])
def test_invalid_fractions(value, message):
    with pytest.raises(DeviceError, match=message):
        check_memory_fraction(value)


def test_on_the_cpu_it_is_a_logged_no_op(captured):
    logger, handler = captured
    assert set_gpu_memory_fraction(0.5, "cpu", log=logger) == []
    assert handler.messages() == ["--gpu-memory-fraction has no effect on cpu: only CUDA devices have a "
                                  "per-process cap"]


def test_bad_fraction_fails_before_looking_at_devices():
    with pytest.raises(DeviceError, match=r"\(0, 1\]"):
        set_gpu_memory_fraction(2.0, "cpu")


def test_a_gpu_this_process_cannot_see_is_an_error():
    missing = cuda_device_count() + 1
    with pytest.raises(DeviceError, match=f"device cuda:{missing} is not available; available devices: cpu"):
        set_gpu_memory_fraction(0.5, [torch.device("cpu"), torch.device("cuda", missing)])


_CAP_SCRIPT = """
import logging, torch
from polytrain.devices.memory import set_gpu_memory_fraction
logging.basicConfig(level=logging.INFO)
assert set_gpu_memory_fraction(0.05, ["cuda:0", "cuda:0", "cpu"]) == [torch.device("cuda", 0)]
total = torch.cuda.get_device_properties(0).total_memory
small = torch.empty(int(total * 0.01), dtype=torch.uint8, device="cuda:0")
try:
    torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda:0")
except torch.OutOfMemoryError:
    print("capped")
"""


@pytest.mark.gpu
def test_the_cap_stops_allocations_beyond_the_fraction():
    env = dict(os.environ, PYTHONPATH=SRC)  # a fresh process: the cap lasts for the process's lifetime
    done = subprocess.run([sys.executable, "-c", _CAP_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "capped"
    assert "GPU memory cap: 5% of cuda:0" in done.stderr
