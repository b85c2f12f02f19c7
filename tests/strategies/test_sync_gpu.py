"""The CUDA paths of ``single`` and ``sync``, from the CLI as users run them (skipped without a GPU).

One GPU is enough for most of it: two gloo workers can share ``cuda:0``, which runs DDP on CUDA tensors
(``device_ids``, CUDA buckets, gloo's CUDA all-reduce) exactly as on two GPUs; only NCCL needs a GPU per
worker, and its test is marked ``multigpu``.
"""

import json
import subprocess
import sys

import pytest
import torch

COMMON = ["--model", "mlp", "--data", "digits", "--steps", "20", "--batch-size", "64", "--seed", "1",
          "--lr", "0.01", "--progress", "lines"]


def polytrain(*args, env, timeout=300):
    return subprocess.run([sys.executable, "-m", "polytrain", "train", *COMMON, *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _relative_errors(a_path, b_path) -> dict[str, float]:
    a = torch.load(a_path, weights_only=True)
    b = torch.load(b_path, weights_only=True)
    assert a.keys() == b.keys()
    return {k: ((a[k].float() - b[k].float()).norm() / a[k].float().norm().clamp_min(1e-12)).item() for k in a}


def _end(path) -> dict:
    return next(e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "end")


@pytest.mark.gpu
def test_single_on_the_gpu_trains_like_single_on_the_cpu(cli_env, tmp_path):
    cpu = polytrain("--strategy", "single", "--device", "cpu", "--save-model", str(tmp_path / "cpu.pt"), env=cli_env)
    gpu = polytrain("--strategy", "single", "--device", "cuda:0", "--save-model", str(tmp_path / "gpu.pt"),
                    "--metrics-file", str(tmp_path / "gpu.jsonl"), env=cli_env)
    assert cpu.returncode == 0 and gpu.returncode == 0, cpu.stderr + gpu.stderr
    assert "1 process on cuda:0" in gpu.stdout
    errors = _relative_errors(tmp_path / "cpu.pt", tmp_path / "gpu.pt")
    assert max(errors.values()) <= 1e-4, errors  # other kernels, other summation order: not bit-equal
    assert _end(tmp_path / "gpu.jsonl")["steps"] == 20


@pytest.mark.gpu
@pytest.mark.parametrize("balance, note", [
    ("auto", "equal slices (workers on cuda; --balance on to balance)"),
    ("on", "slices balanced by measured speed"),
])
def test_sync_on_cuda_tensors_equals_single_on_the_gpu(cli_env, tmp_path, balance, note):
    """Two gloo workers on one GPU: DDP's CUDA path, averaged over gloo, against single on the same GPU."""
    single = polytrain("--strategy", "single", "--device", "cuda:0", "--save-model", str(tmp_path / "single.pt"),
                       env=cli_env)
    sync = polytrain("--strategy", "sync", "--workers", "2", "--device", "cuda:0", "--backend", "gloo",
                     "--balance", balance, "--save-model", str(tmp_path / "sync.pt"), env=cli_env)
    assert single.returncode == 0 and sync.returncode == 0, single.stderr + sync.stderr
    assert "backend gloo, rank 0 on cuda:0" in sync.stdout and note in sync.stdout
    errors = _relative_errors(tmp_path / "single.pt", tmp_path / "sync.pt")
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.gpu
@pytest.mark.parametrize("soft, message", [
    (False, "device 'cuda:{extra}' (from 'cuda') is not available"),
    (True, "backend nccl needs one GPU per worker: {workers} workers"),  # soft placement would share a GPU
])
def test_more_workers_than_gpus_is_one_clear_error(cli_env, soft, message):
    workers = torch.cuda.device_count() + 1
    proc = polytrain("--strategy", "sync", "--workers", str(workers), "--device", "cuda",
                     *(["--soft-placement"] if soft else []), env=cli_env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert message.format(extra=workers - 1, workers=workers) in proc.stderr


@pytest.mark.multigpu
def test_sync_over_nccl_equals_single(cli_env, tmp_path):
    single = polytrain("--strategy", "single", "--device", "cuda:0", "--save-model", str(tmp_path / "single.pt"),
                       env=cli_env)
    sync = polytrain("--strategy", "sync", "--device", "cuda:0,1", "--save-model", str(tmp_path / "sync.pt"),
                     env=cli_env)
    assert single.returncode == 0 and sync.returncode == 0, single.stderr + sync.stderr
    assert "backend nccl" in sync.stdout
    errors = _relative_errors(tmp_path / "single.pt", tmp_path / "sync.pt")
    assert max(errors.values()) <= 1e-5, errors
