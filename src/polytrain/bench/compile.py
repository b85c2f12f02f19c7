"""``polytrain bench --suite compile``: the speed ``--compile`` gains and ``--activation-checkpointing full``
costs, on the same model and batches, in one run.

Four cases of ``single`` (one worker, one thread), each through ``polytrain.fit`` as a user runs it: eager,
``--compile``, ``--activation-checkpointing full``, and both. Each is timed from the end of its warm-up steps
(compilation happens in the first step) to its last step, from the metrics file's step records; the cases
run in interleaved repeats (each repeat starting one case later) and each ratio is the median of the
per-repeat ratios, so a slow phase of a shared machine falls on no case in particular. The first step's
seconds (compilation; inductor's on-disk cache makes later repeats' shorter), the peak memory and the final
loss are reported per case.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.cases import interleaved, tokens_per_example
from polytrain.bench.measure import BenchError
from polytrain.bench.report import environment
from polytrain.errors import ConfigError


@dataclass(frozen=True)
class CompileBenchConfig:
    # 4 blocks of width 128 over 128 tokens: tens of ms a step on one core, so the per-op overhead that
    # compiling removes and the recompute that checkpointing adds are both visible
    model: str = "transformer_lm:layers=4,dim=128,heads=4"
    data: str = "text:seq_len=128"
    batch_size: int = 16
    warmup: int = 3
    steps: int = 20
    repeats: int = 3
    lr: float = 0.01
    seed: int = 0

    def check(self) -> None:
        """Raise ConfigError naming the bad setting before anything starts."""
        from polytrain.models.registry import resolve_model_factory

        for name in ("batch_size", "warmup", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        resolve_model_factory(self.model)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class UnitCase:
    key: str
    label: str
    settings: dict


CASES = (
    UnitCase("eager", "eager", {}),
    UnitCase("compiled", "--compile", {"compile": True}),
    UnitCase("checkpointed", "--activation-checkpointing full", {"activation_checkpointing": "full"}),
    UnitCase("compiled_checkpointed", "--compile --activation-checkpointing full",
             {"compile": True, "activation_checkpointing": "full"}),
)

#: (key, label, numerator case, denominator case): speed ratios, > 1 is faster
RATIOS = (
    ("compiled_vs_eager", "--compile / eager", "compiled", "eager"),
    ("checkpointed_vs_eager", "--activation-checkpointing full / eager", "checkpointed", "eager"),
    ("compiled_checkpointed_vs_checkpointed", "both / --activation-checkpointing full alone",
     "compiled_checkpointed", "checkpointed"),
)


def run_case(case: UnitCase, cfg: CompileBenchConfig, repeat: int, workdir: Path) -> dict[str, float]:
    from polytrain.api import fit
    from polytrain.data.registry import build_data

    metrics = workdir / f"{case.key}-{repeat}.jsonl"
    steps = cfg.warmup + cfg.steps
    # without its test split: the run's final evaluation (under no_grad, which torch.compile guards on) would
    # compile every unit a second time, which is no part of the training speed measured here
    data = dataclasses.replace(build_data(cfg.data, seed=cfg.seed), test=None)
    summary = fit(model=cfg.model, data=data, strategy="single", threads_per_worker=1, device="cpu",
                  batch_size=cfg.batch_size, steps=steps, optimizer="sgd", lr=cfg.lr, seed=cfg.seed,
                  log_every=1, eval_every=0, histogram_every=0, progress="off", metrics_file=str(metrics),
                  **case.settings)
    records = {r["step"]: r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"}
    if cfg.warmup not in records or steps not in records:
        raise BenchError(f"{case.label}: the metrics file {metrics} has no step record {cfg.warmup} or {steps}; "
                         f"it has {sorted(records)}")
    window = records[steps]["time_s"] - records[cfg.warmup]["time_s"]
    return {"examples_per_sec": cfg.steps * cfg.batch_size / window, "first_step_s": records[1]["time_s"],
            "peak_memory_mb": summary.get("peak_memory_mb"), "final_loss": records[steps]["loss"]}


def run_suite(cfg: CompileBenchConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    cfg.check()
    order = interleaved(list(CASES), cfg.repeats)
    runs: dict[str, list[dict[str, float]]] = {case.key: [] for case in CASES}
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-compile-") as tmp:
        for i, (repeat, case) in enumerate(order, 1):
            measured = run_case(case, cfg, repeat, Path(tmp))
            runs[case.key].append(measured)
            progress(f"[{i}/{len(order)}] repeat {repeat + 1}: {case.label}: "
                     f"{measured['examples_per_sec']:.1f} examples/s, first step {measured['first_step_s']:.1f} s")
    tokens = tokens_per_example(cfg.data, cfg.seed)
    rows = []
    for case in CASES:
        mine = runs[case.key]
        rate = statistics.median(m["examples_per_sec"] for m in mine)
        rows.append({"case": case.key, "label": case.label, "examples_per_sec": round(rate, 2),
                     "tokens_per_sec": round(rate * tokens, 1) if tokens else None,
                     "runs_examples_per_sec": [round(m["examples_per_sec"], 2) for m in mine],
                     "first_step_s": [round(m["first_step_s"], 2) for m in mine],
                     "peak_memory_mb": [m["peak_memory_mb"] for m in mine],
                     "final_loss": round(mine[-1]["final_loss"], 6)})
    ratios = []
    for key, label, num, den in RATIOS:
        paired = [a["examples_per_sec"] / b["examples_per_sec"] for a, b in zip(runs[num], runs[den])]
        ratios.append({"key": key, "label": label, "value": round(statistics.median(paired), 4),
                       "per_repeat": [round(v, 4) for v in paired]})
    return {"suite": "compile", "config": cfg.to_dict(), "env": environment(), "rows": rows, "ratios": ratios}


def _peak(row: dict[str, Any]) -> str:
    """The median of the runs' peak memory (the whole process's: it moves from run to run by tens of MiB)."""
    peaks = [p for p in row["peak_memory_mb"] if p is not None]
    return f"{statistics.median(peaks):.0f}" if peaks else "-"


def format_text(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    lines = [f"{cfg['model']} on {cfg['data']}; single, 1 thread, batch {cfg['batch_size']}; median of "
             f"{cfg['repeats']} interleaved repeat(s) of {cfg['steps']} steps after {cfg['warmup']} warm-up; "
             f"{env['cores']} cores ({env['cpu']}), torch {env['torch']}", ""]
    width = max(len(row["label"]) for row in doc["rows"])
    lines.append(f"{'case':<{width}} {'examples/s':>11} {'first step s':>13} {'peak MiB':>9} {'final loss':>11}  runs")
    for row in doc["rows"]:
        runs = " ".join(f"{r:.1f}" for r in row["runs_examples_per_sec"])
        lines.append(f"{row['label']:<{width}} {row['examples_per_sec']:>11.1f} {max(row['first_step_s']):>13.1f} "
                     f"{_peak(row):>9} {row['final_loss']:>11.5f}  {runs}")
    lines.append("")
    width = max(len(ratio["label"]) for ratio in doc["ratios"])
    for ratio in doc["ratios"]:
        spread = f"{min(ratio['per_repeat']):.3f}-{max(ratio['per_repeat']):.3f}"
        lines.append(f"speed {ratio['label']:<{width}} {ratio['value']:>6.3f}  ({spread})")
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    cfg, env = doc["config"], doc["env"]
    lines = [f"`{cfg['model']}` on `{cfg['data']}`, single, 1 thread, batch {cfg['batch_size']}, median of "
             f"{cfg['repeats']} interleaved repeats of {cfg['steps']} steps after {cfg['warmup']} warm-up "
             f"(torch {env['torch']}, {env['cores']} cores, {env['cpu']})", "",
             "| case | examples/s | runs | first step s (max) | peak MiB (median) | final loss |",
             "|---|---|---|---|---|---|"]
    for row in doc["rows"]:
        runs = ", ".join(f"{r:.1f}" for r in row["runs_examples_per_sec"])
        lines.append(f"| {row['label']} | {row['examples_per_sec']:.1f} | {runs} | {max(row['first_step_s']):.1f} | "
                     f"{_peak(row)} | {row['final_loss']:.5f} |")
    lines += ["", "| speed ratio | median | per repeat |", "|---|---|---|"]
    for ratio in doc["ratios"]:
        per_repeat = ", ".join(f"{v:.3f}" for v in ratio["per_repeat"])
        lines.append(f"| {ratio['label']} | {ratio['value']:.3f} | {per_repeat} |")
    return "\n".join(lines) + "\n"
