"""Device discovery: what `polytrain devices` lists, how it prints, and CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from polytrain.devices.discovery import (
    DeviceInfo,
    available_device_names,
    format_bytes,
    format_devices,
    list_devices,
    usable_cores,
)

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
_LIST_SCRIPT = ("import json; from polytrain.devices.discovery import list_devices, format_devices; "
                "d = list_devices(); print(json.dumps([x.to_dict() for x in d])); print(format_devices(d))")


def test_the_cpu_comes_first_with_its_cores():
    devices = list_devices()
    cpu = devices[0]
    assert (cpu.name, cpu.kind) == ("cpu", "cpu")
    assert cpu.cores == usable_cores() >= 1
    if sys.platform.startswith("linux"):
        assert cpu.memory_bytes and cpu.memory_bytes > 2**20


def test_cuda_devices_follow_pytorch_numbering():
    devices = list_devices()
    cuda = [d for d in devices if d.kind == "cuda"]
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert [d.name for d in cuda] == [f"cuda:{i}" for i in range(expected)]
    assert [d.name for d in devices] == available_device_names()


def test_to_dict_is_json_ready():
    record = list_devices()[0].to_dict()
    assert set(record) == {"name", "kind", "description", "memory_bytes", "cores"}
    assert json.loads(json.dumps(record)) == record


def test_table_columns_line_up():
    devices = [
        DeviceInfo("cpu", "cpu", "Some CPU", 64 * 2**30, 16),
        DeviceInfo("cuda:0", "cuda", "NVIDIA H100 80GB HBM3 (compute 9.0, 132 SMs)", 85_000_000_000),
        DeviceInfo("cuda:1", "cuda", "NVIDIA A100", None),
    ]
    lines = format_devices(devices, notes=False).splitlines()
    assert len(lines) == 4
    assert lines[0].split() == ["DEVICE", "KIND", "MEMORY", "CORES", "DESCRIPTION"]
    for column in ("KIND", "MEMORY", "CORES", "DESCRIPTION"):
        start = lines[0].index(column)
        assert all(line[start - 2:start] == "  " and line[start] != " " for line in lines[1:]), column
    assert "64.0 GiB" in lines[1] and "79.2 GiB" in lines[2]
    assert lines[3].split()[:4] == ["cuda:1", "cuda", "-", "-"]


def test_notes_explain_missing_cuda_and_visibility(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    text = format_devices([DeviceInfo("cpu", "cpu", "x", None, 2)])
    assert "no CUDA devices: " in text
    assert "CUDA_VISIBLE_DEVICES='1': CUDA indices above are the visible ones" in text


@pytest.mark.parametrize("count,text", [(None, "-"), (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"),
                                        (3 * 2**30, "3.0 GiB"), (5 * 2**40, "5.0 TiB")])
def test_format_bytes(count, text):
    assert format_bytes(count) == text


def _list_in_subprocess(visible: str) -> tuple[list[dict], str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible, PYTHONPATH=SRC)
    done = subprocess.run([sys.executable, "-c", _LIST_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120, check=True)
    first, _, table = done.stdout.partition("\n")
    return json.loads(first), table


def test_empty_cuda_visible_devices_hides_every_gpu():
    devices, table = _list_in_subprocess("")
    assert [d["kind"] for d in devices] == ["cpu"] + (["mps"] if len(devices) > 1 else [])
    assert "cuda:" not in table
    assert "CUDA_VISIBLE_DEVICES=''" in table


@pytest.mark.gpu
def test_cuda_visible_devices_renumbers_from_zero():
    last = torch.cuda.device_count() - 1
    expected = torch.cuda.get_device_properties(last).name
    devices, _ = _list_in_subprocess(str(last))
    cuda = [d for d in devices if d["kind"] == "cuda"]
    assert [d["name"] for d in cuda] == ["cuda:0"]
    assert cuda[0]["description"].startswith(expected)
    assert cuda[0]["memory_bytes"] == torch.cuda.get_device_properties(last).total_memory
