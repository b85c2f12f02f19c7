"""Goodput under failures: ``python -m polytrain.bench.goodput``.

One job (``--workers 4`` CPU processes, ``sync``, ``digits_cnn``), in one invocation:

* **clean**: no checkpoint, no failure, run before and after the others (the machine's load drifts; the
  clean time is their mean);
* **failing**: the same steps with ``--checkpoint-every C``, ``--max-restarts`` and a worker SIGKILLed every
  ``--fail-every N`` steps of progress (``POLYTRAIN_INJECT_KILL``): each failure stops all workers, restarts
  them and resumes from the latest checkpoint, redoing the steps since. goodput = useful steps / wall time
  relative to the clean run = ``clean_s / failing_s``.

A failure every N steps of a short run is far more often than one per 5 minutes, and on a shared
machine the wall times of two long runs differ by more than a restart costs, so the cost of one failure is
also measured directly, in parts:

* **detect and stop**: from the moment the killed rank dies (it writes the time first,
  ``POLYTRAIN_INJECT_KILL_LOG``) to the moment every worker is stopped and the restart begins (the restart
  record's time);
* **start and resume**: the wall time of a run that resumes the failing run's last checkpoint and trains one
  step (workers started, data and model built, checkpoint loaded and verified, one step, the end's
  checkpoint), less one step: a bound from above;
* **checkpoint**: one checkpoint's cost, from a run logging every step (the interval holding a checkpoint,
  less the median interval);
* **redone work**: on average half a checkpoint interval.

From these, the goodput at one failure every ``--interval`` seconds (default 300) with a checkpoint every
T seconds::

    implied = (1 - checkpoint_s / T) * (1 - (detect_stop_s + start_resume_s + T / 2) / interval)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from polytrain.train.faults import KILL_ENV, KILL_LOG_ENV

DEFAULTS = dict(model="digits_cnn", data="digits", batch_size=128, progress="off", eval_every=0, log_every=10,
                strategy="sync", workers=4, lr=0.05)


def kill_steps(steps: int, fail_every: int) -> list[int]:
    """The step after which each attempt's victim dies: every ``fail_every`` steps of progress."""
    return list(range(fail_every, steps, fail_every))


def _timed_fit(settings: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    import polytrain

    started = time.perf_counter()
    summary = polytrain.fit(**settings)
    return time.perf_counter() - started, summary


def _records(path: Path, event: str) -> list[dict[str, Any]]:
    with open(path) as fh:
        return [r for r in map(json.loads, fh) if r.get("event") == event]


def checkpoint_cost(base: dict[str, Any], steps: int, every: int, workdir: Path) -> float:
    """One checkpoint's seconds: the step interval that holds one, less the median step interval."""
    metrics = workdir / "checkpointed.jsonl"
    _timed_fit({**base, "steps": steps, "log_every": 1, "checkpoint_dir": str(workdir / "checkpointed"),
                "checkpoint_every": every, "metrics_file": str(metrics)})
    times = {r["step"]: r["time_s"] for r in _records(metrics, "step")}
    intervals = {s: times[s] - times[s - 1] for s in times if s - 1 in times}
    typical = statistics.median(intervals.values())
    with_checkpoint = [intervals[s + 1] for s in range(every, steps, every) if s + 1 in intervals]
    return max(0.0, statistics.median(with_checkpoint) - typical)


def failing_run(base: dict[str, Any], steps: int, fail_every: int, every: int,
                workdir: Path) -> tuple[float, dict[str, Any], list[float]]:
    """The run with failures: its wall time, summary, and each failure's seconds from death to restart."""
    kills = kill_steps(steps, fail_every)
    log = workdir / "kills.txt"
    os.environ[KILL_ENV] = f"rank=1,steps={'+'.join(map(str, kills))}"
    os.environ[KILL_LOG_ENV] = str(log)
    try:
        wall, summary = _timed_fit({**base, "steps": steps, "checkpoint_dir": str(workdir / "failing"),
                                    "checkpoint_every": every, "max_restarts": len(kills)})
    finally:
        os.environ.pop(KILL_ENV, None)
        os.environ.pop(KILL_LOG_ENV, None)
    assert summary["restarts"] == len(kills), summary.get("restart_causes")
    died = [float(line.split()[2]) for line in log.read_text().splitlines()]
    stopped = [c["unix_time"] for c in summary["restart_causes"]]
    return wall, summary, [s - d for d, s in zip(died, stopped)]


def start_and_resume(base: dict[str, Any], checkpoints: Path, workdir: Path, step_s: float,
                     repeats: int = 3) -> float:
    """Seconds from nothing running to training again: resume the last checkpoint and train one step."""
    from polytrain.train.checkpoint import Checkpointer

    last = max(Checkpointer(checkpoints).steps())
    walls = []
    for repeat in range(repeats):
        copy = workdir / f"resume-{repeat}"
        shutil.copytree(checkpoints, copy)
        wall, _ = _timed_fit({**base, "steps": last + 1, "checkpoint_dir": str(copy), "resume": True})
        walls.append(wall - step_s)
    return statistics.median(walls)


def measure(steps: int, fail_every: int, every: int, workdir: Path,
            overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    base = {**DEFAULTS, **(overrides or {})}
    _timed_fit({**base, "steps": 5})  # warm-up: the launcher's forkserver starts once, on the first launch
    clean_before, _ = _timed_fit({**base, "steps": steps})
    fail_s, summary, detect_stop = failing_run(base, steps, fail_every, every, workdir)
    clean_after, _ = _timed_fit({**base, "steps": steps})
    clean_s = (clean_before + clean_after) / 2
    step_s = clean_s / steps
    resume_s = start_and_resume(base, workdir / "failing", workdir, step_s)
    ckpt_s = checkpoint_cost(base, min(steps, 10 * every), every, workdir)
    return {
        "steps": steps, "fail_every": fail_every, "checkpoint_every": every, "failures": summary["restarts"],
        "clean_runs_s": [round(clean_before, 3), round(clean_after, 3)], "clean_s": round(clean_s, 3),
        "failing_s": round(fail_s, 3), "goodput_measured": round(clean_s / fail_s, 4),
        "step_s": round(step_s, 5),
        "detect_stop_s": [round(t, 3) for t in detect_stop],
        "start_resume_s": round(resume_s, 3),
        "restart_fixed_s": round(statistics.mean(detect_stop) + resume_s, 3),
        "checkpoint_s": round(ckpt_s, 4),
        "restart_causes": [c["cause"] for c in summary["restart_causes"]],
    }


def implied_goodput(result: dict[str, Any], interval_s: float, checkpoint_seconds: float) -> float:
    """The share of wall time left for useful steps with a checkpoint every ``checkpoint_seconds`` (each
    costing the measured time) and a failure every ``interval_s`` (each costing the measured fixed restart
    time and, on average, half a checkpoint interval of redone steps)."""
    saving = result["checkpoint_s"] / checkpoint_seconds
    lost = result["restart_fixed_s"] + checkpoint_seconds / 2
    return round((1 - saving) * (1 - lost / interval_s), 4)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polytrain.bench.goodput", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--fail-every", type=int, default=150, help="steps of progress between failures")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--interval", type=float, default=300.0, help="seconds between failures to extrapolate to")
    parser.add_argument("--checkpoint-seconds", type=float, nargs="+", default=[10.0, 30.0, 60.0],
                        help="checkpoint intervals (seconds) to extrapolate for")
    parser.add_argument("--out", help="write the result as JSON here (and a .md next to it)")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="polytrain-goodput-") as tmp:
        result = measure(args.steps, args.fail_every, args.checkpoint_every, Path(tmp))
    result["implied"] = {f"{s:g}": implied_goodput(result, args.interval, s) for s in args.checkpoint_seconds}
    result["interval_s"] = args.interval
    result["machine"] = {"cpus": os.cpu_count(), "load_1min_before": round(load, 2),
                         "load_1min_after": round(os.getloadavg()[0], 2), "python": platform.python_version()}
    text = report(result)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(text + "\n")
    return 0


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"goodput: {DEFAULTS['workers']} CPU workers, {DEFAULTS['strategy']}, {DEFAULTS['model']}, {r['steps']} steps, "
        f"a worker SIGKILLed every {r['fail_every']} steps ({r['failures']} failures), checkpoint every "
        f"{r['checkpoint_every']} steps; {m['cpus']} CPUs at load {m['load_1min_before']} -> {m['load_1min_after']}",
        "",
        "| run | wall s | goodput (clean s / run s) |",
        "|---|---|---|",
        f"| clean (mean of {' and '.join(f'{t:.2f}' for t in r['clean_runs_s'])}, before and after) | "
        f"{r['clean_s']:.2f} | 1.0000 |",
        f"| failing, restarted ({r['failures']} failures) | {r['failing_s']:.2f} | {r['goodput_measured']:.4f} |",
        "",
        "one failure, measured in parts:",
        "",
        "| part | seconds |",
        "|---|---|",
        f"| death to every worker stopped (each failure) | {', '.join(f'{t:.2f}' for t in r['detect_stop_s'])} |",
        f"| start and resume (median of 3, upper bound) | {r['start_resume_s']:.2f} |",
        f"| fixed cost of one restart | {r['restart_fixed_s']:.2f} |",
        f"| one checkpoint | {r['checkpoint_s']:.3f} |",
        f"| one step | {r['step_s']:.4f} |",
        "",
        f"implied goodput at one failure every {r['interval_s']:g} s: (1 - checkpoint / T) x "
        "(1 - (restart cost + T/2 redone) / failure interval):",
        "",
        "| checkpoint every T (s) | implied goodput |",
        "|---|---|",
        *[f"| {s} | {g:.4f} |" for s, g in r["implied"].items()],
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
