"""``polytrain bench --suite tp``: ``--strategy tp`` against a plain ``parallelize_module`` loop on the same
model and batches, in one run.

Two cases train the same model from the same initial values on the same batches with the same optimizer:

* ``polytrain --strategy tp --workers T --tp T`` through ``polytrain.fit`` as a user runs it (1 thread a
  worker), timed from its metrics file's step records (the end of the warm-up to the last step, rank 0's clock),
  logging every ``--warmup`` steps (10 by default: polytrain's default ``--log-every``), each log point's work
  counted in the time;
* the plain loop (:mod:`polytrain.bench.tp_reference`): ``parallelize_module`` with a hand-written plan over a
  1-D mesh, zero_grad / forward / cross-entropy / backward / step, its own ``python`` process, timed over the
  same steps; its final loss the mean of the same last steps as polytrain's last record.

With ``--dp-shard S`` (fsdp x tp on one ``dp_shard x tp`` mesh, ``S x T`` processes): ``polytrain --strategy
fsdp --workers S*T --tp T`` against the plain loop with ``fully_shard`` over ``dp_shard`` after
``parallelize_module`` over ``tp`` (each dp_shard rank its slice of the global batch).

They run in interleaved repeats (each repeat starting one case later); the speed ratio tp / plain is the median
of the per-repeat ratios, with their min and max, over the timed window and by the median step.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.cases import tokens_per_example
from polytrain.bench.measure import BenchError, run_reference
from polytrain.bench.paired import case_row, measure_interleaved, paired_ratio
from polytrain.bench.report import environment
from polytrain.errors import ConfigError

#: the speed polytrain tp should keep of the plain loop's
TARGET = 0.98


@dataclass(frozen=True)
class TpBenchConfig:
    # 4 blocks of width 256 over 128 tokens: 3.4 M parameters, a step of a few hundred ms on one core, so the
    # activations' all-reduces are a real part of it
    model: str = "transformer_lm:layers=4,dim=256,heads=4"
    data: str = "text:seq_len=128"
    batch_size: int = 8
    workers: int = 2  # = --tp: one replica
    dp_shard: int = 1  # > 1: fsdp x tp, each tp group's model also sharded over dp_shard ranks
    warmup: int = 10  # also polytrain's log interval: its default --log-every
    steps: int = 20
    repeats: int = 3
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 300.0
    host_memory: str = "cache"  # both cases: like for like

    def check(self) -> None:
        from polytrain.data.registry import check_data
        from polytrain.models.registry import resolve_model_factory

        for name in ("batch_size", "warmup", "steps", "repeats", "dp_shard"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.workers < 2:
            raise ConfigError(f"--workers must be >= 2 for --suite tp (one rank splits nothing), got {self.workers}")
        if self.batch_size % self.dp_shard:
            raise ConfigError(f"--dp-shard {self.dp_shard} does not divide --batch-size {self.batch_size}; each "
                              "dp_shard rank takes an equal slice of it")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"--optimizer must be adam or sgd for --suite tp, got '{self.optimizer}'")
        if not self.model.split(":")[0] == "transformer_lm":
            raise ConfigError(f"--suite tp measures transformer_lm (the plain loop's plan is written for it), got "
                              f"--model {self.model}")
        resolve_model_factory(self.model)
        size = check_data(self.data)
        if size is not None and size < self.batch_size:
            raise ConfigError(f"--data {self.data}: {size} training examples, fewer than one batch "
                              f"({self.batch_size}); use more data or a smaller batch")

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class TpCase:
    key: str
    label: str


def cases(cfg: TpBenchConfig) -> list[TpCase]:
    n, s = cfg.workers, cfg.dp_shard
    if s > 1:
        return [TpCase("tp", f"polytrain --strategy fsdp --tp {n} (--dp-shard {s}), {n * s} workers x 1 thread"),
                TpCase("plain", f"plain parallelize_module + fully_shard loop, {n * s} workers x 1 thread")]
    return [TpCase("tp", f"polytrain --strategy tp --tp {n}, {n} workers x 1 thread"),
            TpCase("plain", f"plain parallelize_module loop, {n} workers x 1 thread")]


def _ratio_label(cfg: TpBenchConfig) -> str:
    return "polytrain fsdp x tp / plain parallelize_module + fully_shard loop" if cfg.dp_shard > 1 else \
        "polytrain tp / plain parallelize_module loop"


def describe(cfg: TpBenchConfig) -> str:
    takes = "every tp rank takes all of it" if cfg.dp_shard == 1 else \
        f"each of the {cfg.dp_shard} dp_shard ranks a slice, every tp rank of it all of the slice"
    lines = [f"{cfg.model} on {cfg.data}, global batch {cfg.batch_size} ({takes}), "
             f"{cfg.optimizer} lr {cfg.lr:g}, {cfg.warmup} warm-up + {cfg.steps} timed steps, {cfg.repeats} "
             f"interleaved repeat(s), --host-memory {cfg.host_memory}:"]
    return "\n".join(lines + [f"  {case.key:<6} {case.label}" for case in cases(cfg)])


def run_polytrain(cfg: TpBenchConfig, repeat: int, workdir: Path, save_model: Path | None = None) -> dict[str, Any]:
    from polytrain.api import fit

    metrics = workdir / f"tp-{repeat}.jsonl"
    total = cfg.warmup + cfg.steps
    fit(model=cfg.model, data=cfg.data, strategy="tp" if cfg.dp_shard == 1 else "fsdp",
        workers=str(cfg.workers * cfg.dp_shard), tp=cfg.workers,
        threads_per_worker=1, batch_size=cfg.batch_size, steps=total, optimizer=cfg.optimizer, lr=cfg.lr,
        seed=cfg.seed, device="cpu", timeout=cfg.timeout, host_memory=cfg.host_memory, log_every=cfg.warmup, eval_every=0,
        histogram_every=0, progress="off", metrics_file=str(metrics),
        **({"save_model": str(save_model)} if save_model else {}))
    records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"}
    if cfg.warmup not in records or total not in records:
        raise BenchError(f"polytrain tp: the metrics file {metrics} has no step record {cfg.warmup} or {total}")
    window = records[total]["time_s"] - records[cfg.warmup]["time_s"]
    ends = sorted(step for step in records if step >= cfg.warmup)  # each log interval's mean step
    steps = [(records[b]["time_s"] - records[a]["time_s"]) / (b - a) for a, b in zip(ends, ends[1:])]
    return {"examples_per_sec": cfg.steps * cfg.batch_size / window, "window_s": window, "step_s": steps,
            "final_loss": records[total]["loss"]}


def plain_command(cfg: TpBenchConfig, result: Path, save_model: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "polytrain.bench.tp_reference", "--workers", str(cfg.workers), "--dp-shard",
           str(cfg.dp_shard), "--threads", "1",
           "--model", cfg.model, "--data", cfg.data, "--batch-size", str(cfg.batch_size),
           "--warmup", str(cfg.warmup), "--steps", str(cfg.steps), "--optimizer", cfg.optimizer,
           "--lr", str(cfg.lr), "--seed", str(cfg.seed), "--timeout", str(cfg.timeout), "--interval", str(cfg.warmup),
           "--host-memory", cfg.host_memory, "--result", str(result)]
    return cmd + (["--save-model", str(save_model)] if save_model else [])


def run_case(case: TpCase, cfg: TpBenchConfig, repeat: int, workdir: Path) -> dict[str, Any]:
    if case.key == "tp":
        measured = run_polytrain(cfg, repeat, workdir)
    else:
        result = workdir / f"plain-{repeat}.json"
        measured = run_reference(case.label, plain_command(cfg, result), result, cfg)
    steps = measured.get("step_s") or [measured["window_s"] / cfg.steps]
    measured["step_examples_per_sec"] = cfg.batch_size / statistics.median(steps)
    return measured


def run_suite(cfg: TpBenchConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    cfg.check()
    chosen = cases(cfg)
    runs = measure_interleaved(chosen, cfg.repeats, lambda case, repeat, tmp: run_case(case, cfg, repeat, tmp),
                               "polytrain-bench-tp-", progress)
    tokens = tokens_per_example(cfg.data, cfg.seed)
    rows = [case_row(case, runs[case.key], tokens) for case in chosen]
    ratios = [paired_ratio(key, label, runs["tp"], runs["plain"], measure, target)
              for key, label, measure, target in (("tp_vs_plain", _ratio_label(cfg), "examples_per_sec", TARGET),
                                                  ("tp_vs_plain_median_step", "the same, median step",
                                                   "step_examples_per_sec", None))]
    return {"suite": "tp", "config": cfg.to_dict(), "env": environment(), "rows": rows, "ratios": ratios}


def _header(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    shard = cfg.get("dp_shard", 1)
    degrees = f"--dp-shard {shard} x --tp {cfg['workers']}" if shard > 1 else f"--tp {cfg['workers']}"
    return (f"{cfg['model']} on {cfg['data']}; {degrees}: {cfg['workers'] * shard} workers x 1 thread, global "
            f"batch {cfg['batch_size']}, {cfg['optimizer']}; median of {cfg['repeats']} interleaved repeat(s) of "
            f"{cfg['steps']} steps after {cfg['warmup']} warm-up; --host-memory {cfg['host_memory']}; "
            f"{env['cores']} cores ({env['cpu']}), torch {env['torch']}")


def format_text(doc: dict[str, Any]) -> str:
    lines = [_header(doc), ""]
    width = max(len(row["label"]) for row in doc["rows"])
    lines.append(f"{'case':<{width}} {'examples/s':>11} {'tokens/s':>9} {'median step':>12} {'final loss':>11}  runs")
    for row in doc["rows"]:
        tokens = f"{row['tokens_per_sec']:.0f}" if row["tokens_per_sec"] else "-"
        runs = " ".join(f"{r:.1f}" for r in row["runs_examples_per_sec"])
        lines.append(f"{row['label']:<{width}} {row['examples_per_sec']:>11.1f} {tokens:>9} "
                     f"{row['step_examples_per_sec']:>12.1f} {row['final_loss']:>11.5f}  {runs}")
    lines.append("")
    width = max(len(r["label"]) for r in doc["ratios"])
    for r in doc["ratios"]:
        target = "" if r["target"] is None else f"  target >= {r['target']:.2f}: {'met' if r['met'] else 'NOT met'}"
        lines.append(f"speed {r['label']:<{width}} {r['value']:.3f} ({r['min']:.3f}-{r['max']:.3f}){target}")
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    lines = [_header(doc), "", "| case | examples/s | tokens/s | runs | examples/s by the median step | final loss |",
             "|---|---:|---:|---|---:|---:|"]
    for row in doc["rows"]:
        tokens = f"{row['tokens_per_sec']:.0f}" if row["tokens_per_sec"] else "-"
        runs = ", ".join(f"{r:.1f}" for r in row["runs_examples_per_sec"])
        lines.append(f"| {row['label']} | {row['examples_per_sec']:.1f} | {tokens} | {runs} | "
                     f"{row['step_examples_per_sec']:.1f} | {row['final_loss']:.5f} |")
    lines += ["", "| speed ratio | median | min-max | per repeat | target |", "|---|---:|---|---|---|"]
    for r in doc["ratios"]:
        per_repeat = ", ".join(f"{v:.3f}" for v in r["per_repeat"])
        target = "" if r["target"] is None else f">= {r['target']:.2f}: {'met' if r['met'] else 'not met'}"
        lines.append(f"| {r['label']} | {r['value']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {per_repeat} | {target} |")
    return "\n".join(lines) + "\n"
