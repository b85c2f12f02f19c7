"""Where polytrain's own time in a ``single`` step goes, by part: the profile of ``bench --suite overhead``.

``cProfile`` runs ``polytrain.fit`` in this process twice, with the warm-up alone and with the warm-up and the
timed steps; the difference, divided by the timed steps, is what one steady step costs (start-up, the first
steps and the final evaluation cancel out). polytrain's own time is the Python of its modules and the torch or
builtin calls made directly from them (``tensor.detach()`` in the loss, ``time.perf_counter()`` in the loop); the
model's forward, backward and the optimizer are the training itself, which the plain loop does too. Profiled
times are several times the real ones (every call is counted); the parts' shares are what to read.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path
from typing import Any, Callable

#: the parts of a step, by the module (path under polytrain/) and, where one module holds several, function
PARTS = (
    ("phases.py", None, "phases"),
    ("train/metrics.py", ("observe", "take_mean", "first_bad", "first_divergence"), "NaN guard"),
    ("train/metrics.py", None, "metrics"),
    ("train/example_ids.py", None, "metrics"),
    ("train/trainer.py", ("_stop_after", "_ends_with_collective"), "stop check"),
    ("distributed/stop.py", None, "stop check"),
    ("heartbeat", None, "heartbeat"),
    ("train/memory.py", None, "memory meter"),
    ("strategies/step.py", None, "loss reduction"),
    ("tasks.py", None, "loss reduction"),
    ("precision.py", None, "loss reduction"),
    ("train/trainer.py", ("_step_record",), "log points"),
    ("train/loggers.py", None, "log points"),
    ("train/trackers.py", None, "log points"),
    ("log.py", None, "log points"),
    ("distributed/topology.py", None, "log points"),
    ("data/", None, "data"),  # the dataset's get_batch and the plan's global_indices and position: the plain loop's too
    ("train/lr_schedules.py", None, "lr schedule"),
    ("strategies/", None, "strategy step"),
    ("optim", None, "strategy step"),
    ("train/trainer.py", None, "loop"),
    ("devices/", None, "device runtime"),
    ("train/faults.py", None, "loop"),
    ("train/straggler.py", None, "loop"),
)


def part_of(filename: str, function: str) -> str | None:
    """The part of a step a polytrain function belongs to; None outside polytrain."""
    tail = filename.replace("\\", "/").rpartition("/polytrain/")
    if not tail[1]:
        return None
    path = tail[2]
    for where, names, part in PARTS:
        if (path.startswith(where) or where in path) and (names is None or function in names):
            return part
    return "other"


def own_time(stats: pstats.Stats) -> dict[tuple[str, int, str], tuple[int, float]]:
    """(calls, seconds) per function of polytrain's own: its Python, and the non-Python calls made straight from
    it (their seconds go to the polytrain function that called them)."""
    out: dict[tuple[str, int, str], tuple[int, float]] = {}
    raw = stats.stats  # type: ignore[attr-defined]
    for func, (_, calls, tottime, _, callers) in raw.items():
        if part_of(func[0], func[2]) is not None:
            mine = out.get(func, (calls, 0.0))
            out[func] = (calls, mine[1] + tottime)
        elif func[0] == "~":
            for caller, (_, _, caller_tt, _) in callers.items():
                if part_of(caller[0], caller[2]) is not None:
                    mine = out.get(caller, (raw[caller][1] if caller in raw else 0, 0.0))
                    out[caller] = (mine[0], mine[1] + caller_tt)
    return out


def _profiled(run_polytrain: Callable[..., Any], row: Any, cfg: Any, workdir: Path, steps: int,
              tag: str) -> tuple[dict, float]:
    """polytrain's own seconds per function, and the profiled seconds in all, of a run of ``steps`` after the
    warm-up."""
    from dataclasses import replace

    profiler = cProfile.Profile(time.process_time)  # CPU seconds: what a neighbour's load leaves alone
    profiler.enable()
    try:
        run_polytrain(row, replace(cfg, steps=steps), workdir, f"profile-{tag}")
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)
    return own_time(stats), stats.total_tt  # type: ignore[attr-defined]


def profile_single(run_polytrain: Callable[..., Any], row: Any, cfg: Any, workdir: Path,
                   top: int = 8) -> dict[str, Any]:
    """polytrain's own microseconds per steady step of ``row`` (a single row, run by ``run_polytrain(row, cfg,
    workdir, tag)``), by part and by function."""
    base, base_total = _profiled(run_polytrain, row, cfg, workdir, cfg.warmup, "short")
    long, long_total = _profiled(run_polytrain, row, cfg, workdir, cfg.warmup + cfg.steps, "long")
    steps = cfg.steps  # the steps the long run has more
    # a function of the steps is called at least once per log point more in the longer run; start-up's functions
    # (the config, the model's build) as often in both, whatever their seconds
    per_step = {func: max(0.0, (seconds - base.get(func, (0, 0.0))[1]) / steps * 1e6)
                for func, (calls, seconds) in long.items()
                if calls - base.get(func, (0, 0.0))[0] >= max(1, steps // cfg.warmup)}
    parts: dict[str, float] = {}
    for (filename, _, function), us in per_step.items():
        part = part_of(filename, function) or "other"
        parts[part] = parts.get(part, 0.0) + us
    functions = sorted(per_step.items(), key=lambda item: -item[1])[:top]
    return {"row": row.key, "steps": steps,
            "step_us_profiled": round((long_total - base_total) / steps * 1e6, 1),
            "own_us": round(sum(per_step.values()), 1),
            "parts_us": {k: round(v, 1) for k, v in sorted(parts.items(), key=lambda item: -item[1])},
            "functions_us": [{"function": f"{_short(f)}:{line} {name}", "us": round(us, 1)}
                             for (f, line, name), us in functions]}


def _short(filename: str) -> str:
    head, sep, tail = filename.replace("\\", "/").rpartition("/polytrain/")
    return f"polytrain/{tail}" if sep else filename
