"""From measurements to the rows, ratios and tables that ``polytrain bench`` prints and writes.

Every ratio divides numbers taken in the same run (medians over interleaved repeats), because absolute
throughput on a shared machine drifts from one minute to the next.
"""

from __future__ import annotations

import datetime
import platform
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from polytrain import __version__
from polytrain.bench.cases import BenchConfig, Case
from polytrain.bench.measure import Measurement
from polytrain.distributed.launch import available_cores

#: (key, description, numerator case, denominator case, workers factor on the denominator, target)
RATIOS = (
    ("sync_vs_ddp", "polytrain sync / plain DDP", "sync", "ddp", False, 0.98),
    ("sync_gloo_vs_ddp", "polytrain sync --comm backend / plain DDP (both gloo)", "sync_gloo", "ddp", False, None),
    ("balanced_vs_equal", "polytrain sync --balance auto / sync (what balancing gains)", "sync_balanced", "sync",
     False, None),
    ("sync_weak_scaling", "weak scaling: sync N / (N x single 1 thread)", "sync", "single_1t", True, 0.90),
    ("sync_balanced_weak_scaling", "weak scaling: sync --balance auto N / (N x single 1 thread)", "sync_balanced",
     "single_1t", True, None),
    ("sync_gloo_weak_scaling", "weak scaling: sync --comm backend N / (N x single 1 thread)", "sync_gloo",
     "single_1t", True, None),
    ("ddp_weak_scaling", "weak scaling: DDP N / (N x single 1 thread)", "ddp", "single_1t", True, None),
    ("ceiling_weak_scaling", "weak scaling without any exchange (the ceiling)", "no_exchange", "single_1t", True,
     None),
    ("sync_vs_ceiling", "sync N / the same N workers without exchange", "sync", "no_exchange", False, None),
    ("sync_vs_single_all", "sync N x 1 thread / single with all cores", "sync", "single_all", False, None),
)


@dataclass(frozen=True)
class Row:
    case: Case
    runs: list[float]
    final_loss: float

    @property
    def median(self) -> float:
        return statistics.median(self.runs)

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {"case": c.key, "label": c.label, "runner": c.runner, "strategy": c.strategy, "workers": c.workers,
                "threads_per_worker": c.threads, "global_batch": c.global_batch,
                "examples_per_sec": round(self.median, 2), "sec_per_batch": round(c.global_batch / self.median, 5),
                "runs_examples_per_sec": [round(r, 2) for r in self.runs], "final_loss": round(self.final_loss, 5)}


def rows(cases: list[Case], measurements: list[Measurement]) -> list[Row]:
    out = []
    for case in cases:
        mine = sorted((m for m in measurements if m.case == case.key), key=lambda m: m.repeat)
        out.append(Row(case, [m.examples_per_sec for m in mine], mine[-1].final_loss))
    return out


def ratios(table: list[Row], workers: int) -> list[dict[str, Any]]:
    """Each ratio is the median over repeats of the ratio within a repeat: the two cases of a pair ran
    minutes apart at most, so the machine's slow drift cancels out of every per-repeat ratio."""
    by_key = {r.case.key: r for r in table}
    out = []
    for key, label, num, den, per_worker, target in RATIOS:
        factor = workers if per_worker else 1
        paired = [a / (b * factor) for a, b in zip(by_key[num].runs, by_key[den].runs)]
        value = statistics.median(paired)
        out.append({"key": key, "label": label.replace("N", str(workers)), "value": round(value, 4),
                    "per_repeat": [round(v, 4) for v in paired], "target": target,
                    "met": None if target is None else value >= target})
    return out


def environment() -> dict[str, Any]:
    return {"polytrain": __version__, "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu": _cpu_model(), "cores": available_cores(),
            "threads_default": torch.get_num_threads(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def result_document(cfg: BenchConfig, table: list[Row], tokens_per_example: float | None = None) -> dict[str, Any]:
    """``tokens_per_example`` (language-model data) adds tokens/s to every row; the ratios are the same
    whether counted in examples or tokens, since every case trains on the same batches."""
    doc = {"config": cfg.to_dict(), "env": environment(), "rows": [r.to_dict() for r in table],
           "ratios": ratios(table, cfg.workers)}
    if tokens_per_example is not None:
        doc["tokens_per_example"] = tokens_per_example
        for row in doc["rows"]:
            row["tokens_per_sec"] = round(row["examples_per_sec"] * tokens_per_example, 1)
    return doc


def _verdict(ratio: dict[str, Any]) -> str:
    if ratio["target"] is None:
        return ""
    return f"target >= {ratio['target']:.2f}: {'met' if ratio['met'] else 'NOT met'}"


def format_text(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    lines = [f"{cfg['model']} on {cfg['data']}; {cfg['worker_batch_size']} examples per worker per step; "
             f"median of {cfg['repeats']} interleaved repeat(s) of {cfg['steps']} steps after {cfg['warmup']} "
             f"warm-up; {env['cores']} cores ({env['cpu']}), torch {env['torch']}", ""]
    case_width = max(len(row["label"]) for row in doc["rows"])
    ratio_width = max(len(ratio["label"]) for ratio in doc["ratios"])
    tokens = "tokens_per_example" in doc
    lines.append(f"{'case':<{case_width}} {'workers x threads':>17} {'batch':>6} {'examples/s':>11} "
                 + (f"{'tokens/s':>10} " if tokens else "") + f"{'s/batch':>8}  runs")
    for row in doc["rows"]:
        runs = " ".join(f"{r:.0f}" for r in row["runs_examples_per_sec"])
        lines.append(f"{row['label']:<{case_width}} {row['workers']:>8} x {row['threads_per_worker']:<6} "
                     f"{row['global_batch']:>6} {row['examples_per_sec']:>11.1f} "
                     + (f"{row['tokens_per_sec']:>10.0f} " if tokens else "") + f"{row['sec_per_batch']:>8.4f}  {runs}")
    lines.append("")
    for ratio in doc["ratios"]:
        spread = f"{min(ratio['per_repeat']):.3f}-{max(ratio['per_repeat']):.3f}"
        lines.append(f"{ratio['label']:<{ratio_width}} {ratio['value']:>6.3f}  ({spread:<11})  "
                     f"{_verdict(ratio)}".rstrip())
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    tokens = "tokens_per_example" in doc
    lines = [f"`{cfg['model']}` on `{cfg['data']}`, {cfg['worker_batch_size']} examples per worker per step, "
             f"median of {cfg['repeats']} interleaved repeats of {cfg['steps']} timed steps after "
             f"{cfg['warmup']} warm-up steps. {env['cores']} cores ({env['cpu']}), torch {env['torch']}, "
             f"Python {env['python']}, {env['date']}.", "",
             "| case | workers × threads | global batch | examples/s (median) | "
             + ("tokens/s | " if tokens else "") + "s/batch | runs |",
             "|---|---:|---:|---:|" + ("---:|" if tokens else "") + "---:|---|"]
    for row in doc["rows"]:
        runs = ", ".join(f"{r:.0f}" for r in row["runs_examples_per_sec"])
        lines.append(f"| {row['label']} | {row['workers']} × {row['threads_per_worker']} | {row['global_batch']} | "
                     f"{row['examples_per_sec']:.1f} | " + (f"{row['tokens_per_sec']:.0f} | " if tokens else "")
                     + f"{row['sec_per_batch']:.4f} | {runs} |")
    lines += ["", "| ratio (median of per-repeat ratios) | value | per repeat | target |", "|---|---:|---|---|"]
    for ratio in doc["ratios"]:
        per_repeat = ", ".join(f"{v:.3f}" for v in ratio["per_repeat"])
        lines.append(f"| {ratio['label']} | {ratio['value']:.3f} | {per_repeat} | {_verdict(ratio) or '—'} |")
    return "\n".join(lines) + "\n"

