"""``polytrain bench``: polytrain's strategies against each other and against plain PyTorch DDP.

``run_bench(cfg)`` runs every case of :func:`~polytrain.bench.cases.plan` ``cfg.repeats`` times, interleaved,
and returns the result document (config, environment, median rows, ratios) that the CLI prints and saves.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from polytrain.bench.cases import BenchConfig, Case, describe, interleaved, plan, tokens_per_example
from polytrain.bench.measure import BenchError, Measurement, run_case
from polytrain.bench.report import format_markdown, format_text, result_document, rows

__all__ = ["BenchConfig", "BenchError", "Case", "describe", "format_markdown", "format_text", "plan", "run_bench"]


def run_bench(cfg: BenchConfig, progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    cfg.check()
    cases = plan(cfg)
    order = interleaved(cases, cfg.repeats)
    measurements: list[Measurement] = []
    with tempfile.TemporaryDirectory(prefix="polytrain-bench-") as tmp:
        for i, (repeat, case) in enumerate(order, 1):
            m = run_case(case, cfg, repeat, Path(tmp))
            measurements.append(m)
            progress(f"[{i}/{len(order)}] repeat {repeat + 1}: {case.label}: {m.examples_per_sec:.1f} examples/s")
    return result_document(cfg, rows(cases, measurements), tokens_per_example(cfg.data, cfg.seed))
