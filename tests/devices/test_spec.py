"""The device-name parser over every accepted form and over bad ones, and the resolution rules."""

from __future__ import annotations

import logging

import pytest
import torch

from polytrain.devices.discovery import available_device_names, cuda_device_count, mps_available
from polytrain.devices.spec import DeviceSpec, default_backend, parse_device, resolve_device
from polytrain.errors import DeviceError, PolytrainError

GOOD = [
    # text, type, indices, count, canonical
    ("cpu", "cpu", (), None, "cpu"),
    ("cpu:0", "cpu", (0,), None, "cpu:0"),
    ("cpu:4", "cpu", (), 4, "cpu:4"),
    ("cpu:1", "cpu", (), 1, "cpu:1"),
    ("cuda", "cuda", (), None, "cuda"),
    ("cuda:1", "cuda", (1,), None, "cuda:1"),
    ("gpu", "cuda", (), None, "cuda"),
    ("gpu:1", "cuda", (1,), None, "cuda:1"),
    ("GPU:1", "cuda", (1,), None, "cuda:1"),
    ("/gpu:1", "cuda", (1,), None, "cuda:1"),
    ("/GPU:1", "cuda", (1,), None, "cuda:1"),
    ("/device:GPU:1", "cuda", (1,), None, "cuda:1"),
    ("device:GPU:1", "cuda", (1,), None, "cuda:1"),
    ("/physical_device:GPU:0", "cuda", (0,), None, "cuda:0"),
    ("/job:localhost/replica:0/task:0/device:GPU:1", "cuda", (1,), None, "cuda:1"),
    ("/job:localhost/replica:0/task:0/device:CPU:0", "cpu", (0,), None, "cpu:0"),
    ("/device:GPU:*", "cuda", (), None, "cuda"),
    ("/cpu:0", "cpu", (0,), None, "cpu:0"),
    ("/device:CPU:0", "cpu", (0,), None, "cpu:0"),
    ("mps", "mps", (), None, "mps"),
    ("mps:0", "mps", (0,), None, "mps:0"),
    ("auto", "auto", (), None, "auto"),
    ("AUTO", "auto", (), None, "auto"),
    ("cuda:0,1", "cuda", (0, 1), None, "cuda:0,1"),
    ("cuda:2, 0", "cuda", (2, 0), None, "cuda:2,0"),
    ("cuda:0,cuda:1", "cuda", (0, 1), None, "cuda:0,1"),
    ("gpu:0,1,2,3", "cuda", (0, 1, 2, 3), None, "cuda:0,1,2,3"),
    ("/gpu:0,/gpu:1", "cuda", (0, 1), None, "cuda:0,1"),
    ("  cuda:3  ", "cuda", (3,), None, "cuda:3"),
]


@pytest.mark.parametrize("text,kind,indices,count,canonical", GOOD)
def test_accepted_forms(text, kind, indices, count, canonical):
    spec = parse_device(text)
    assert (spec.type, spec.indices, spec.count) == (kind, indices, count)
    assert str(spec) == canonical
    assert spec.text == text
    assert parse_device(canonical) == spec  # the canonical form means the same thing


def test_worker_counts_and_lists():
    assert parse_device("cpu:4").workers == 4
    assert parse_device("cuda:0,1").workers == 2
    assert parse_device("cuda:1").workers is None
    assert parse_device("cpu:0").workers is None  # cpu:0 is the CPU device, not zero workers
    assert parse_device("cuda:0,1").is_list and not parse_device("cuda:0,1").is_single_device
    assert parse_device("cpu:4").is_single_device is False
    assert parse_device("auto").is_single_device


BAD = [
    ("", "empty"),
    ("   ", "empty"),
    ("tpu", "'tpu' is not a device type"),
    ("/device:TPU:0", "'tpu' is not a device type"),
    ("xla:0", "'xla' is not a device type"),
    ("cuda:", "not a device index"),
    ("cuda:-1", "not a device index"),
    ("cuda:one", "not a device index"),
    ("cuda:1.5", "not a device index"),
    ("gpu1", "not a device type"),
    ("auto:1", "'auto' takes no index"),
    ("mps:1", "one MPS device"),
    ("/cpu:1", "for N CPU workers write cpu:N"),
    ("cpu:0,1", "only CUDA devices can be listed"),
    ("cuda:0,0", "listed twice"),
    ("cuda:0,,1", "empty item"),
    ("cuda:0,", "empty item"),
    (",cuda:0", "starts with a comma"),
    ("cuda:0,mps", "not a CUDA device index"),
    ("cuda:0,cpu", "not a CUDA device index"),
    ("cuda,1", "a list gives each device's index"),
    ("/", "names no device"),
    ("/gpu:x", "not a device index"),
    ("/foo:1/device:GPU:0", "is not /job:, /replica:, /task: or /device:"),
]


@pytest.mark.parametrize("text,reason", BAD)
def test_garbage_is_rejected_with_the_accepted_forms(text, reason):
    with pytest.raises(DeviceError) as info:
        parse_device(text)
    message = str(info.value)
    assert reason in message
    assert f"'{text}'" in message
    assert "accepted forms: cpu, cpu:0, cpu:N" in message and "/job:localhost/replica:0/task:0/device:GPU:1" in message
    assert "\n" not in message  # the CLI prints it as one line


@pytest.mark.parametrize("text,hint", [
    ("/job:ps/replica:0/task:0/device:GPU:0", "names TensorFlow job 'ps'"),
    ("/job:localhost/replica:0/task:1/device:GPU:0", "task:1 is another process"),
    ("/job:localhost/replica:2/task:0/device:GPU:0", "replica:2 is another process"),
])
def test_tensorflow_names_of_other_processes_are_refused(text, hint):
    with pytest.raises(DeviceError, match="--workers") as info:
        parse_device(text)
    assert hint in str(info.value)


def test_non_text_is_refused():
    with pytest.raises(DeviceError, match="must be text"):
        parse_device(3)  # type: ignore[arg-type]


def test_device_error_is_a_user_error():
    assert issubclass(DeviceError, PolytrainError)


def test_cpu_forms_resolve_to_the_cpu():
    for text in ("cpu", "cpu:0", "cpu:4", "/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"):
        assert resolve_device(text, local_rank=3) == torch.device("cpu")


def test_auto_picks_the_best_available_device():
    expected = "cuda:0" if cuda_device_count() else "mps:0" if mps_available() else "cpu"
    assert str(resolve_device("auto")) == expected


def _missing_index() -> int:
    return cuda_device_count() + 1


def _soft_fallback(index: int) -> torch.device:
    count = cuda_device_count()
    return torch.device("cuda", index % count) if count else torch.device("cpu")


def test_missing_device_error_names_it_and_the_available_devices():
    index = _missing_index()
    with pytest.raises(DeviceError) as info:
        resolve_device(f"cuda:{index}")
    message = str(info.value)
    assert f"device 'cuda:{index}' is not available" in message
    assert "available devices: " + ", ".join(available_device_names()) in message
    assert "--soft-placement" in message


def test_tensorflow_name_is_quoted_in_the_error():
    index = _missing_index()
    with pytest.raises(DeviceError, match=rf"'cuda:{index}' \(from '/device:GPU:{index}'\)"):
        resolve_device(f"/device:GPU:{index}")


def test_soft_falls_back_with_one_warning(captured):
    logger, handler = captured
    index = _missing_index()
    assert resolve_device(f"gpu:{index}", soft=True, log=logger) == _soft_fallback(index)
    warnings = handler.messages(logging.WARNING)
    assert len(warnings) == 1
    assert f"'cuda:{index}' is not available" in warnings[0]
    assert f"using {_soft_fallback(index)} instead" in warnings[0]


def test_a_list_gives_each_local_worker_its_entry():
    # indices beyond any machine's GPUs, so the error shows which entry each worker took
    for rank, index in enumerate((97, 98, 99)):
        with pytest.raises(DeviceError, match=f"'cuda:{index}' \\(from 'cuda:97,98,99'\\)"):
            resolve_device("cuda:97,98,99", local_rank=rank)


def test_a_list_shorter_than_the_workers_is_an_error():
    with pytest.raises(DeviceError, match="has 2 devices but this is local worker 2; list one device per worker"):
        resolve_device("cuda:0,1", local_rank=2, soft=True)


def test_bare_cuda_means_the_workers_own_gpu():
    rank = _missing_index()
    with pytest.raises(DeviceError, match=f"'cuda:{rank}' \\(from 'cuda'\\)"):
        resolve_device("cuda", local_rank=rank)


@pytest.mark.skipif(mps_available(), reason="MPS is available here")
def test_unavailable_mps(captured):
    logger, handler = captured
    with pytest.raises(DeviceError, match="device 'mps' is not available: MPS is not available"):
        resolve_device("mps")
    assert resolve_device("mps", soft=True, log=logger) == torch.device("cpu")
    assert len(handler.messages(logging.WARNING)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_without_cuda_the_error_says_why():
    with pytest.raises(DeviceError, match="no CUDA support|CUDA_VISIBLE_DEVICES|no CUDA device"):
        resolve_device("cuda:0")


def test_negative_local_rank_is_a_bug():
    with pytest.raises(ValueError):
        resolve_device("cpu", local_rank=-1)


def test_default_backend():
    assert default_backend(torch.device("cuda", 1)) == "nccl"
    assert default_backend("cpu") == "gloo"
    assert default_backend(torch.device("mps")) == "gloo"


@pytest.mark.gpu
def test_visible_gpus_resolve_to_themselves():
    last = torch.cuda.device_count() - 1
    assert resolve_device(f"/gpu:{last}") == torch.device("cuda", last)
    assert resolve_device("cuda", local_rank=last) == torch.device("cuda", last)
    assert resolve_device("auto", local_rank=last) == torch.device("cuda", last)


@pytest.mark.multigpu
def test_a_list_on_real_gpus():
    assert resolve_device("cuda:1,0", local_rank=0) == torch.device("cuda", 1)
    assert resolve_device("cuda:1,0", local_rank=1) == torch.device("cuda", 0)


def test_spec_equality_ignores_the_text():
    assert DeviceSpec("cuda", (1,), text="/gpu:1") == DeviceSpec("cuda", (1,), text="cuda:1")
