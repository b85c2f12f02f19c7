"""Running one benchmark case and reading its steady-state throughput.

Both runners time the same window: from the end of the warm-up steps to the end of the last step, wall
clock on rank 0, everything in between included (data, forward, backward, gradient exchange, optimizer,
and for polytrain its loss check and logging). polytrain runs go through ``polytrain.fit`` exactly as a
user's would and are read back from the metrics file (``time_s`` of the step records); the plain DDP
script runs as its own ``python`` process and writes its measurement to a JSON file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.bench.cases import BenchConfig, Case
from polytrain.errors import PolytrainError


class BenchError(PolytrainError):
    """A benchmark case that did not run to the end."""


@dataclass(frozen=True)
class Measurement:
    case: str
    repeat: int
    examples_per_sec: float
    window_s: float
    final_loss: float


def run_case(case: Case, cfg: BenchConfig, repeat: int, workdir: Path) -> Measurement:
    runner = run_polytrain if case.runner == "polytrain" else run_ddp
    return runner(case, cfg, repeat, workdir)


def run_polytrain(case: Case, cfg: BenchConfig, repeat: int, workdir: Path) -> Measurement:
    from polytrain.api import fit

    metrics = workdir / f"{case.key}-{repeat}.jsonl"
    fit(model=cfg.model, data=cfg.data, strategy=case.strategy, workers=str(case.workers),
        threads_per_worker=case.threads, batch_size=case.global_batch, steps=cfg.warmup + cfg.steps,
        optimizer="sgd", lr=cfg.lr, momentum=cfg.momentum, seed=cfg.seed, device="cpu", timeout=cfg.timeout,
        comm=case.comm, balance=case.balance, host_memory=cfg.host_memory,
        log_every=cfg.warmup, eval_every=0, histogram_every=0, progress="off", metrics_file=str(metrics))
    return window_from_metrics(case, repeat, metrics, cfg.warmup, cfg.warmup + cfg.steps)


def window_from_metrics(case: Case, repeat: int, metrics: Path, start_step: int, end_step: int) -> Measurement:
    """Throughput between the step records at ``start_step`` and ``end_step`` of a metrics file."""
    records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"}
    try:
        first, last = records[start_step], records[end_step]
    except KeyError as exc:
        raise BenchError(f"{case.label}: the metrics file {metrics} has no step record {exc}; "
                         f"it has {sorted(records)}") from None
    window = last["time_s"] - first["time_s"]
    rate = (end_step - start_step) * case.global_batch / window
    return Measurement(case.key, repeat, rate, window, last["loss"])


def ddp_command(case: Case, cfg: BenchConfig, result: Path, save_model: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "polytrain.bench.ddp_reference", "--workers", str(case.workers),
           "--threads", str(case.threads), "--model", cfg.model, "--data", cfg.data,
           "--worker-batch-size", str(case.global_batch // case.workers), "--warmup", str(cfg.warmup),
           "--steps", str(cfg.steps), "--lr", str(cfg.lr), "--momentum", str(cfg.momentum),
           "--seed", str(cfg.seed), "--timeout", str(cfg.timeout), "--result", str(result),
           "--host-memory", cfg.host_memory]
    cmd += [] if case.exchange else ["--no-sync"]
    return cmd + (["--save-model", str(save_model)] if save_model else [])


def run_reference(label: str, command: list[str], result: Path, cfg: Any) -> dict[str, Any]:
    """Run a plain PyTorch reference script (``command``) and read the measurement it wrote to ``result``;
    a BenchError with the end of its output if it fails or never finishes."""
    # generous: the script's own collectives time out after cfg.timeout; this only catches a stuck start
    deadline = cfg.timeout + 60 + 10 * (cfg.warmup + cfg.steps)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=deadline)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{label}: no result after {deadline:.0f} s") from None
    if done.returncode != 0 or not result.exists():
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise BenchError(f"{label} failed (exit code {done.returncode}):\n{tail}")
    return json.loads(result.read_text())


def run_ddp(case: Case, cfg: BenchConfig, repeat: int, workdir: Path) -> Measurement:
    result = workdir / f"{case.key}-{repeat}.json"
    out = run_reference(case.label, ddp_command(case, cfg, result), result, cfg)
    return Measurement(case.key, repeat, out["examples_per_sec"], out["window_s"], out["final_loss"])
