"""``polytrain bench --suite pipeline-soak``: every pipeline configuration of the parity tests, run long.

A run of 200 steps per configuration must never hang. Each configuration (P=2 and 4,
M in {P, 2P}, every schedule the installed torch provides that accepts them, and hybrid dp 2 x pp 2) runs
as its own ``polytrain train`` process on a tiny ``transformer_lm`` with evaluation every 100 steps, under
a wall-clock limit: past it, the process group is killed and the configuration is reported ``hung``. A run
that exits non-zero (its collectives time out after ``--collective-timeout`` s, a worker failed) is
``failed``; ``ok`` needs exit code 0 and the last step's record in the metrics file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.pipeline import installed_schedules
from polytrain.bench.report import environment
from polytrain.errors import ConfigError
from polytrain.parallel.pp import plan


@dataclass(frozen=True)
class SoakConfig:
    # 8 units (embed, 6 blocks, head): enough for P=4 with 2 chunks per rank
    model: str = "transformer_lm:layers=6,dim=16,heads=2"
    data: str = "text:seq_len=16"
    batch_size: int = 16
    steps: int = 200
    stages: tuple[int, ...] = (2, 4)
    schedules: tuple[str, ...] = ()  # empty: every schedule the installed torch provides
    timeout: float = 300.0  # wall-clock seconds per configuration before it counts as hung
    collective_timeout: float = 60.0
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.timeout <= 0:
            raise ConfigError("--steps, --batch-size and --timeout must be positive")
        for name in self.schedules:
            plan.torch_schedule_class(name)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SoakCase:
    label: str
    args: tuple[str, ...]


def soak_cases(cfg: SoakConfig) -> tuple[list[SoakCase], list[str]]:
    out, skipped = [], []
    for p in cfg.stages:
        for name in cfg.schedules or installed_schedules():
            for m in (p, 2 * p):
                try:
                    plan.check_schedule(name, p, m)
                except ConfigError as exc:
                    skipped.append(f"{name} P={p} M={m}: {exc}")
                    continue
                out.append(SoakCase(f"pipeline {name} P={p} M={m}", ("--strategy", "pipeline", "--pp", str(p),
                                    "--microbatches", str(m), "--schedule", name)))
    out.append(SoakCase("hybrid dp=2 x pp=2 1f1b M=2", ("--strategy", "hybrid", "--workers", "4", "--dp-replicate", "2",
                                                         "--pp", "2", "--microbatches", "2", "--schedule", "1f1b")))
    return out, skipped


def command(case: SoakCase, cfg: SoakConfig, metrics: Path) -> list[str]:
    return [sys.executable, "-m", "polytrain", "train", *case.args, "--model", cfg.model, "--data", cfg.data,
            "--batch-size", str(cfg.batch_size), "--steps", str(cfg.steps), "--optimizer", "sgd", "--lr", "0.05",
            "--momentum", "0.9", "--seed", str(cfg.seed), "--device", "cpu", "--threads-per-worker", "1",
            "--timeout", str(cfg.collective_timeout), "--log-every", "50", "--eval-every", "100",
            "--progress", "off", "--metrics-file", str(metrics)]


def run_one(case: SoakCase, cfg: SoakConfig, workdir: Path) -> dict[str, Any]:
    metrics = workdir / f"{len(list(workdir.iterdir()))}.jsonl"
    start = time.perf_counter()
    # its own session, so that a hung run's workers are killed with it (their group is this process's id)
    proc = subprocess.Popen(command(case, cfg, metrics), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=cfg.timeout)
        outcome = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        outcome = "hung"
    seconds = time.perf_counter() - start
    steps = _last_step(metrics)
    if outcome == "ok" and steps != cfg.steps:
        outcome = "failed"
    row = {"config": case.label, "steps": steps, "seconds": round(seconds, 1), "outcome": outcome,
           "exit_code": proc.returncode, "pid": proc.pid}
    if outcome != "ok":
        row["output_tail"] = "\n".join((output or "").strip().splitlines()[-10:])
    return row


def _last_step(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [r["step"] for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"]
    return max(steps, default=0)


def run_soak(cfg: SoakConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    cfg.check()
    chosen, skipped = soak_cases(cfg)
    rows = []
    with tempfile.TemporaryDirectory(prefix="polytrain-soak-") as tmp:
        for i, case in enumerate(chosen, 1):
            row = run_one(case, cfg, Path(tmp))
            rows.append(row)
            progress(f"[{i}/{len(chosen)}] {case.label}: {row['outcome']}, {row['steps']} steps, {row['seconds']} s")
    return {"suite": "pipeline-soak", "config": cfg.to_dict(), "env": environment(), "rows": rows,
            "skipped": skipped, "all_ok": all(r["outcome"] == "ok" for r in rows)}


def format_text(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"{cfg['model']} on {cfg['data']}, batch {cfg['batch_size']}, {cfg['steps']} steps per configuration, "
             f"each limited to {cfg['timeout']:g} s; torch {doc['env']['torch']}, {doc['env']['date']}", "",
             f"{'configuration':<40} {'steps':>5} {'seconds':>8}  outcome"]
    lines += [f"{r['config']:<40} {r['steps']:>5} {r['seconds']:>8.1f}  {r['outcome']}" for r in doc["rows"]]
    for r in doc["rows"]:
        if r["outcome"] != "ok":
            lines += ["", f"{r['config']} ({r['outcome']}, exit code {r['exit_code']}):", r.get("output_tail", "")]
    if doc["skipped"]:
        lines += ["", "not run (the schedule's limits):"] + [f"  {s}" for s in doc["skipped"]]
    ok = sum(r["outcome"] == "ok" for r in doc["rows"])
    lines += ["", f"{ok} of {len(doc['rows'])} configurations ran every step"]
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    lines = [f"`{cfg['model']}` on `{cfg['data']}`, batch {cfg['batch_size']}, {cfg['steps']} steps per "
             f"configuration, each limited to {cfg['timeout']:g} s; torch {doc['env']['torch']}, "
             f"{doc['env']['cores']} cores, {doc['env']['date']}.", "",
             "| configuration | steps | seconds | outcome |", "|---|---:|---:|---|"]
    lines += [f"| {r['config']} | {r['steps']} | {r['seconds']:.1f} | {r['outcome']} |" for r in doc["rows"]]
    if doc["skipped"]:
        lines += ["", "Not run (the schedule's limits): " + "; ".join(doc["skipped"]) + "."]
    return "\n".join(lines) + "\n"
