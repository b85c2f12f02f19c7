"""``polytrain bench --suite fsdp``: ``--strategy fsdp`` against a plain FSDP2 training loop on the same model
and batches, in one run, with each rank's memory.

Three cases train the same model from the same initial values on the same batches with the same optimizer:

* ``polytrain --strategy fsdp --workers N`` through ``polytrain.fit`` as a user runs it (1 thread a worker),
  timed from its metrics file's step records (the end of the warm-up to the last step, rank 0's clock);
* the plain loop (:mod:`polytrain.bench.fsdp_reference`): ``fully_shard`` per unit and at the root over a
  1-D mesh of the workers, zero_grad / forward / cross-entropy / backward / step, run as its own ``python``
  process and timed over the same steps;
* ``polytrain --strategy sync`` with the same workers: what each rank holds when nothing is sharded.

The cases run in interleaved repeats (each repeat starting one case later); the speed ratio fsdp / plain is the
median of the per-repeat ratios, with their min and max. Each rank's memory comes with it: its peak resident
memory (from the start of training: polytrain's trainer, the plain loop's process group; the median over
the repeats, as it moves by tens of MiB between runs) and the bytes of the parameters, gradients and
optimizer state it holds after the last step (a sharded tensor's local shard), counted the same way on
every side (:mod:`polytrain.train.memory`). polytrain evaluates once after its last step (a dataset with a test
split); it does so in batches of the training slice's size, so that its forward without autograd does not set
the peak.
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

MIB = float(1 << 20)
#: the speed polytrain fsdp should keep of the plain loop's
TARGET = 0.98


@dataclass(frozen=True)
class FsdpBenchConfig:
    # 4 blocks of width 256 over 128 tokens: 3.4 M parameters (40 MiB of state with Adam unsharded), a step
    # of a few hundred ms on one core, so the all-gathers and reduce-scatters are a real part of it
    model: str = "transformer_lm:layers=4,dim=256,heads=4"
    data: str = "text:seq_len=128"
    worker_batch_size: int = 8
    workers: int = 2
    warmup: int = 5
    steps: int = 20
    repeats: int = 3
    optimizer: str = "adam"
    lr: float = 1e-3
    seed: int = 0
    timeout: float = 300.0
    host_memory: str = "cache"  # every case, the plain loop's too: like for like

    def check(self) -> None:
        """Raise ConfigError naming the bad setting before anything starts."""
        from polytrain.data.registry import check_data
        from polytrain.devices.host_memory import HOST_MEMORY_CHOICES
        from polytrain.models.registry import resolve_model_factory

        for name in ("worker_batch_size", "warmup", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.workers < 2:
            raise ConfigError(f"--workers must be >= 2 for --suite fsdp (one worker shards nothing), got {self.workers}")
        if self.optimizer not in ("adam", "sgd"):
            raise ConfigError(f"--optimizer must be adam or sgd for --suite fsdp, got '{self.optimizer}'")
        if self.host_memory not in HOST_MEMORY_CHOICES:
            raise ConfigError(f"--host-memory must be one of {', '.join(HOST_MEMORY_CHOICES)}, got '{self.host_memory}'")
        resolve_model_factory(self.model)
        size = check_data(self.data)
        if size is not None and size < self.global_batch:
            raise ConfigError(f"--data {self.data}: {size} training examples, fewer than one global batch "
                              f"({self.workers} x {self.worker_batch_size}); use more data or a smaller batch")

    @property
    def global_batch(self) -> int:
        return self.workers * self.worker_batch_size

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FsdpCase:
    key: str
    label: str
    runner: str  # polytrain | plain
    strategy: str = "fsdp"


def cases(cfg: FsdpBenchConfig) -> list[FsdpCase]:
    """The cases, in the order of the first repeat."""
    n = cfg.workers
    return [FsdpCase("fsdp", f"polytrain --strategy fsdp, {n} workers x 1 thread", "polytrain"),
            FsdpCase("plain", f"plain fully_shard loop, {n} workers x 1 thread", "plain"),
            FsdpCase("sync", f"polytrain --strategy sync, {n} workers x 1 thread", "polytrain", "sync")]


#: (key, label, numerator case, denominator case, measure, target): speed ratios, > 1 is faster; the measure is
#: examples/s over the timed window, or the global batch over the median timed step
RATIOS = (
    ("fsdp_vs_plain", "polytrain fsdp / plain fully_shard loop", "fsdp", "plain", "examples_per_sec", TARGET),
    ("fsdp_vs_plain_median_step", "the same, median step", "fsdp", "plain", "step_examples_per_sec", None),
    ("fsdp_vs_sync", "polytrain fsdp / polytrain sync", "fsdp", "sync", "examples_per_sec", None),
)


def describe(cfg: FsdpBenchConfig) -> str:
    lines = [f"{cfg.model} on {cfg.data}, {cfg.worker_batch_size} examples per worker per step "
             f"(global batch {cfg.global_batch}), {cfg.optimizer} lr {cfg.lr:g}, {cfg.warmup} warm-up + "
             f"{cfg.steps} timed steps, {cfg.repeats} interleaved repeat(s), --host-memory {cfg.host_memory}:"]
    return "\n".join(lines + [f"  {case.key:<6} {case.label}" for case in cases(cfg)])


# -- running one case --------------------------------------------------------------------------------------

def run_polytrain(case: FsdpCase, cfg: FsdpBenchConfig, repeat: int, workdir: Path,
                  save_model: Path | None = None) -> dict[str, Any]:
    from polytrain.api import fit

    metrics = workdir / f"{case.key}-{repeat}.jsonl"
    total = cfg.warmup + cfg.steps
    summary = fit(model=cfg.model, data=cfg.data, strategy=case.strategy, workers=str(cfg.workers),
                  threads_per_worker=1, batch_size=cfg.global_batch, steps=total, optimizer=cfg.optimizer,
                  lr=cfg.lr, seed=cfg.seed, device="cpu", timeout=cfg.timeout, host_memory=cfg.host_memory,
                  log_every=1, eval_every=0, eval_batch_size=cfg.worker_batch_size, histogram_every=0,
                  progress="off", metrics_file=str(metrics),
                  **({"save_model": str(save_model)} if save_model else {}))
    records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"}
    if cfg.warmup not in records or total not in records:
        raise BenchError(f"{case.label}: the metrics file {metrics} has no step record {cfg.warmup} or {total}; "
                         f"it has {sorted(records)}")
    window = records[total]["time_s"] - records[cfg.warmup]["time_s"]
    steps = [records[s + 1]["time_s"] - records[s]["time_s"] for s in range(cfg.warmup, total) if s + 1 in records]
    return {"examples_per_sec": cfg.steps * cfg.global_batch / window, "window_s": window, "step_s": steps,
            "final_loss": records[total]["loss"], "rank_memory_bytes": summary.get("rank_memory_bytes")}


def plain_command(cfg: FsdpBenchConfig, result: Path, save_model: Path | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "polytrain.bench.fsdp_reference", "--workers", str(cfg.workers), "--threads", "1",
           "--model", cfg.model, "--data", cfg.data, "--worker-batch-size", str(cfg.worker_batch_size),
           "--warmup", str(cfg.warmup), "--steps", str(cfg.steps), "--optimizer", cfg.optimizer,
           "--lr", str(cfg.lr), "--seed", str(cfg.seed), "--timeout", str(cfg.timeout),
           "--host-memory", cfg.host_memory, "--result", str(result)]
    return cmd + (["--save-model", str(save_model)] if save_model else [])


def run_plain(case: FsdpCase, cfg: FsdpBenchConfig, repeat: int, workdir: Path,
              save_model: Path | None = None) -> dict[str, Any]:
    result = workdir / f"{case.key}-{repeat}.json"
    return run_reference(case.label, plain_command(cfg, result, save_model), result, cfg)


def run_case(case: FsdpCase, cfg: FsdpBenchConfig, repeat: int, workdir: Path) -> dict[str, Any]:
    """One run's measurement, with ``step_examples_per_sec``: the global batch over the median step's seconds
    (a neighbour's burst of load on a shared machine slows a few steps, which the median leaves out)."""
    measured = (run_polytrain if case.runner == "polytrain" else run_plain)(case, cfg, repeat, workdir)
    steps = measured.get("step_s") or [measured["window_s"] / cfg.steps]
    measured["step_examples_per_sec"] = cfg.global_batch / statistics.median(steps)
    return measured


# -- the suite ---------------------------------------------------------------------------------------------

def run_suite(cfg: FsdpBenchConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    cfg.check()
    chosen = cases(cfg)
    runs = measure_interleaved(chosen, cfg.repeats, lambda case, repeat, tmp: run_case(case, cfg, repeat, tmp),
                               "polytrain-bench-fsdp-", progress)
    tokens = tokens_per_example(cfg.data, cfg.seed)
    rows = [{**case_row(case, runs[case.key], tokens), "memory": memory_rows(runs[case.key])} for case in chosen]
    ratios = [paired_ratio(key, label, runs[num], runs[den], measure, target)
              for key, label, num, den, measure, target in RATIOS]
    return {"suite": "fsdp", "config": cfg.to_dict(), "env": environment(), "rows": rows, "ratios": ratios}


def memory_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: the peak (median over the runs, and every run's), and the state's bytes (the last run's: the
    same in every run) in MiB."""
    per_run = [r["rank_memory_bytes"] for r in runs if r.get("rank_memory_bytes")]
    if not per_run:
        return []
    out = []
    for rank in range(len(per_run[0])):
        peaks = [ranks[rank]["peak"] / MIB for ranks in per_run]
        last = per_run[-1][rank]
        state = {key: round(last[key] / MIB, 3) for key in ("parameters", "gradients", "optimizer")}
        starts = [ranks[rank]["start_rss"] / MIB for ranks in per_run if ranks[rank].get("start_rss")]
        out.append({"rank": rank, "peak_mb": round(statistics.median(peaks), 1),
                    "runs_peak_mb": [round(p, 1) for p in peaks], **{f"{k}_mb": v for k, v in state.items()},
                    "state_mb": round(sum(state.values()), 3),
                    "start_rss_mb": round(statistics.median(starts), 1) if starts else None})
    return out


# -- output ------------------------------------------------------------------------------------------------

def _header(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    return (f"{cfg['model']} on {cfg['data']}; {cfg['workers']} workers x 1 thread, {cfg['worker_batch_size']} "
            f"examples per worker, {cfg['optimizer']}; median of {cfg['repeats']} interleaved repeat(s) of "
            f"{cfg['steps']} steps after {cfg['warmup']} warm-up; --host-memory {cfg['host_memory']}; "
            f"{env['cores']} cores ({env['cpu']}), torch {env['torch']}")


def _ratio_line(ratio: dict[str, Any]) -> str:
    target = "" if ratio["target"] is None else \
        f"  target >= {ratio['target']:.2f}: {'met' if ratio['met'] else 'NOT met'}"
    return f"{ratio['value']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}){target}"


def _start(mem: dict[str, Any]) -> str:
    return "-" if mem.get("start_rss_mb") is None else f"{mem['start_rss_mb']:.1f}"


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
    width = max(len(ratio["label"]) for ratio in doc["ratios"])
    lines += [f"speed {ratio['label']:<{width}} {_ratio_line(ratio)}" for ratio in doc["ratios"]]
    lines += ["", "memory per rank, MiB: peak RSS (median of runs; the plain loop's RSS when training starts beside "
                  "it); parameters + gradients + optimizer state after the last step"]
    lines.append(f"{'case':<8} {'rank':>4} {'peak':>8} {'start':>8} {'params':>9} {'grads':>9} {'optim':>9} "
                 f"{'state':>9}")
    for row in doc["rows"]:
        for mem in row["memory"]:
            lines.append(f"{row['case']:<8} {mem['rank']:>4} {mem['peak_mb']:>8.1f} {_start(mem):>8} "
                         f"{mem['parameters_mb']:>9.2f} {mem['gradients_mb']:>9.2f} {mem['optimizer_mb']:>9.2f} "
                         f"{mem['state_mb']:>9.2f}")
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
    for ratio in doc["ratios"]:
        per_repeat = ", ".join(f"{v:.3f}" for v in ratio["per_repeat"])
        target = "" if ratio["target"] is None else f">= {ratio['target']:.2f}: {'met' if ratio['met'] else 'not met'}"
        lines.append(f"| {ratio['label']} | {ratio['value']:.3f} | {ratio['min']:.3f}-{ratio['max']:.3f} | "
                     f"{per_repeat} | {target} |")
    lines += ["", "| case | rank | peak RSS MiB (median) | RSS at start MiB | parameters MiB | gradients MiB | "
                  "optimizer MiB | state MiB |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in doc["rows"]:
        for mem in row["memory"]:
            lines.append(f"| {row['case']} | {mem['rank']} | {mem['peak_mb']:.1f} | {_start(mem)} | "
                         f"{mem['parameters_mb']:.2f} | "
                         f"{mem['gradients_mb']:.2f} | {mem['optimizer_mb']:.2f} | {mem['state_mb']:.2f} |")
    return "\n".join(lines) + "\n"
