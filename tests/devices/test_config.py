"""The device flags as config: per-value checks, the checks before launch, worker counts and backends."""

from __future__ import annotations

import pytest
import torch

from polytrain.config import resolve, to_toml
from polytrain.devices.config import DeviceConfig, check_device_config
from polytrain.devices.discovery import available_device_names, cuda_device_count
from polytrain.distributed.launch import available_cores, resolve_backend, resolve_workers
from polytrain.errors import ConfigError, DeviceError

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
MISSING = f"cuda:{cuda_device_count() + 1}"  # a GPU index no machine running this test has


def test_device_config_lives_next_to_its_component_and_in_the_run_config():
    from polytrain.options import registered_sections

    assert {section.name: section.cls for section in registered_sections()}["device"] is DeviceConfig
    config = resolve({}, {"device": "/gpu:1", "place": "features=cuda:0", "soft_placement": "true",
                          "gpu_memory_fraction": "0.5", "log_placement_steps": "2"})
    assert isinstance(config.device, DeviceConfig)
    assert (config.device.device, config.device.place, config.device.soft_placement) == ("/gpu:1", "features=cuda:0",
                                                                                       True)
    assert config.device.gpu_memory_fraction == 0.5 and config.device.log_placement_steps == 2
    assert 'place = "features=cuda:0"' in to_toml(config)


@pytest.mark.parametrize("flags, message", [
    ({"device": "tpu:0"}, "--device: bad device 'tpu:0': 'tpu' is not a device type"),
    ({"device": "cuda:0,0"}, "--device: bad device 'cuda:0,0': cuda:0 is listed twice"),
    ({"place": "features"}, "--place: 'features' is not MODULE=DEVICE; write e.g. features=cuda:0"),
    ({"place": "features=cpu:4"}, "--place: 'features=cpu:4' is a CPU worker count"),
    ({"place": "features=gpu1"}, "--place: bad device 'gpu1'"),
    ({"gpu_memory_fraction": "0"}, "--gpu-memory-fraction: must be in (0, 1], got 0.0"),
    ({"log_placement_steps": "0"}, "--log-placement-steps: must be >= 1, got 0"),
])
def test_bad_values_name_the_flag(flags, message):
    with pytest.raises(ConfigError) as info:
        resolve({}, flags)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bad_device_lists_the_accepted_forms():
    with pytest.raises(ConfigError, match="accepted forms: cpu, cpu:0, cpu:N"):
        resolve({}, {"device": "gpu1"})


def test_place_and_placement_are_one_or_the_other_per_source():
    with pytest.raises(ConfigError, match="give only one of them"):
        resolve({}, {"place": "a=cpu", "placement": "plan.toml"})


def test_the_plan_of_the_config(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('"*" = "cpu"\nclassifier = "cpu:0"\n')
    assert DeviceConfig().plan() is None
    assert DeviceConfig(placement=str(path)).plan().entries == (("*", "cpu"), ("classifier", "cpu:0"))
    assert str(DeviceConfig(place="features=/gpu:1").plan()) == "features=/gpu:1"


def test_check_passes_for_available_devices(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('features = "cpu"\n')
    assert check_device_config(DeviceConfig(device="cpu:2", placement=str(path)), workers=2).entries == (
        ("features", "cpu"),)


def test_check_names_the_place_entry_and_the_available_devices():
    with pytest.raises(DeviceError) as info:
        check_device_config(DeviceConfig(place=f"features=cpu,classifier={MISSING}"))
    message = str(info.value)
    assert message.startswith(f"--place (classifier={MISSING}): device '{MISSING}' is not available")
    assert "available devices: " + ", ".join(available_device_names()) in message
    assert "--soft-placement" in message


def test_check_names_the_device_flag():
    with pytest.raises(DeviceError, match=f"^--device: device '{MISSING}' is not available"):
        check_device_config(DeviceConfig(device=MISSING))


def test_check_covers_every_local_worker():
    # bare 'cuda' is each worker's own GPU: the worker after the last visible GPU has none
    missing_rank = cuda_device_count()
    with pytest.raises(DeviceError, match=f"'cuda:{missing_rank}' \\(from 'cuda'\\)"):
        check_device_config(DeviceConfig(device="cuda"), workers=missing_rank + 1)


def test_check_leaves_soft_decisions_to_the_workers(capsys):
    config = DeviceConfig(device=MISSING, place=f"features={MISSING}", soft_placement=True)
    assert str(check_device_config(config, workers=2)) == f"features={MISSING}"
    assert capsys.readouterr() == ("", "")


def test_check_reads_the_placement_file(tmp_path):
    with pytest.raises(DeviceError, match="placement file .*missing.toml' does not exist"):
        check_device_config(DeviceConfig(placement=str(tmp_path / "missing.toml")))


@pytest.mark.parametrize("workers, device, expected", [
    ("2", "cpu:4", 4),       # the device's count replaces the default --workers
    ("auto", "cpu:3", 3),
    ("3", "cpu:3", 3),
    ("2", "cuda:0,1,2", 3),
    ("3", "cpu", 3),
    ("1", "cpu:0", 1),       # cpu:0 is the CPU device, not a count
    (5, "cpu:4", 5),         # an int is a count the caller (e.g. a strategy) already decided
])
def test_resolve_workers(workers, device, expected):
    assert resolve_workers(workers, device) == expected


def test_resolve_workers_auto_on_the_cpu():
    assert resolve_workers("auto", "cpu") == available_cores()


@pytest.mark.parametrize("workers, device, message", [
    ("3", "cpu:4", "--workers 3 and --device cpu:4 (4 workers) disagree; give one of them"),
    ("4", "cuda:0,1", "--workers 4 and --device cuda:0,1 (2 workers) disagree"),
    ("3", "/gpu:0,/gpu:1", "--device /gpu:0,/gpu:1 (2 workers)"),
])
def test_resolve_workers_conflicts(workers, device, message):
    with pytest.raises(ConfigError) as info:
        resolve_workers(workers, device)
    assert message in str(info.value)


def test_resolve_workers_rejects_bad_devices():
    with pytest.raises(DeviceError, match="accepted forms"):
        resolve_workers("2", "tpu")


@NO_CUDA
def test_resolve_backend_without_a_gpu():
    assert resolve_backend("auto", "cpu:2") == "gloo"
    assert resolve_backend("gloo", "cuda") == "gloo"  # explicit: nothing to resolve
    with pytest.raises(DeviceError, match="available devices: cpu"):
        resolve_backend("auto", "cuda")
    assert resolve_backend("auto", "cuda", soft=True) == "gloo"  # the soft fallback is the CPU


def test_resolve_backend_soft_logs_nothing(capsys):
    resolve_backend("auto", MISSING, soft=True)
    assert capsys.readouterr() == ("", "")  # the worker logs its own decision, not the launcher
