"""What the suites that set polytrain beside a plain PyTorch loop (``--suite fsdp``, ``--suite tp``) share:
their cases run in interleaved repeats, each case's row holds the medians over its repeats, and a speed ratio
is the median of the per-repeat ratios, with its spread."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from polytrain.bench.cases import interleaved

Measured = dict[str, Any]


def measure_interleaved(chosen: Sequence[Any], repeats: int, run_case: Callable[[Any, int, Path], Measured],
                        prefix: str, progress: Callable[[str], None]) -> dict[str, list[Measured]]:
    """Each case's measurements, in the order of its repeats; ``run_case(case, repeat, workdir)``."""
    order = interleaved(chosen, repeats)
    runs: dict[str, list[Measured]] = {case.key: [] for case in chosen}
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        for i, (repeat, case) in enumerate(order, 1):
            measured = run_case(case, repeat, Path(tmp))
            runs[case.key].append(measured)
            progress(f"[{i}/{len(order)}] repeat {repeat + 1}: {case.label}: {measured['examples_per_sec']:.1f} "
                     f"examples/s (median step: {measured['step_examples_per_sec']:.1f})")
    return runs


def case_row(case: Any, mine: list[Measured], tokens: float | None) -> dict[str, Any]:
    """One case's row: examples/s over the window and by the median step, each with its repeats."""
    rate = statistics.median(m["examples_per_sec"] for m in mine)
    return {"case": case.key, "label": case.label, "examples_per_sec": round(rate, 2),
            "tokens_per_sec": round(rate * tokens, 1) if tokens else None,
            "runs_examples_per_sec": [round(m["examples_per_sec"], 2) for m in mine],
            "step_examples_per_sec": round(statistics.median(m["step_examples_per_sec"] for m in mine), 2),
            "runs_step_examples_per_sec": [round(m["step_examples_per_sec"], 2) for m in mine],
            "final_loss": round(mine[-1]["final_loss"], 6)}


def paired_ratio(key: str, label: str, mine: list[Measured], theirs: list[Measured], measure: str,
                 target: float | None) -> dict[str, Any]:
    """``mine / theirs`` on ``measure`` repeat by repeat: the median, min, max and whether it meets ``target``."""
    paired = [a[measure] / b[measure] for a, b in zip(mine, theirs)]
    value = statistics.median(paired)
    return {"key": key, "label": label, "measure": measure, "value": round(value, 4), "min": round(min(paired), 4),
            "max": round(max(paired), 4), "per_repeat": [round(v, 4) for v in paired], "target": target,
            "met": None if target is None else value >= target}
