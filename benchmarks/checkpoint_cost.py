"""What a checkpoint every 10 steps costs the step time, against the same run without checkpoints, interleaved in
one run: the 62 M-parameter ``transformer_lm`` of docs/fsdp.md under ``fsdp --workers 4``.

    python benchmarks/checkpoint_cost.py                        # 90 steps: 3 checkpoints measured, --checkpoint-background
    python benchmarks/checkpoint_cost.py --steps 130 --json benchmarks/results/cpu-2core-checkpoint-cost.json

One ``polytrain train`` run checkpoints every ``2 x --window`` steps (``--checkpoint-every 20``, in the background
with ``--checkpoint-background`` unless ``--foreground``) and logs every step. The ``--window`` steps after each
checkpoint carry its whole cost (the step held while the state is copied, then the write competing for the cores);
the ``--window`` steps before it and the ``--window`` after those carry none, and are the same run's steps without
checkpoints. Each checkpoint's window is set against the mean of the two windows without one on either side of it
(a load that rises or falls through the run moves them alike: a window only against the one after it read +53 %
in a run whose load fell from 16 to 7), and ``with / without - 1`` is the cost of a checkpoint every ``--window``
steps. The first window (before the first checkpoint: warm-up) and the run's last checkpoint are left out. The wall seconds of a window
are the difference of the step records' ``time_s`` (wall clock since the loop began, everything included).

The script also reads the time each checkpoint's part files were written (their modification time) against the
unix time it saw each step record appear: a write still going when its "without" window began would make that
window slower and the cost look smaller, and is reported (``spilled``).

A second reading is the trainers' rank 0's own CPU seconds (``cpu_s``: every thread of its process, the
checkpoint's writer included) in the same windows: the extra CPU the checkpoints cost it, which the load of other
work moves much less than wall time. Prints each pair, the median cost and the spread, the machine's load (``os.getloadavg``) before and after, and the
run's ``checkpoint_stall_s``. Exit status 1 when the median cost is above ``--target`` (5 %).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "transformer_lm:layers=8,dim=800,heads=8"


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _command(args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "polytrain", "train", "--strategy", "fsdp", "--workers", "4", "--model", args.model,
           "--data", "text:seq_len=32", "--batch-size", "8", "--optimizer", "adam", "--lr", "0.001",
           "--steps", str(args.steps), "--eval-every", "0", "--log-every", "1", "--progress", "off",
           "--timeout", "900", "--seed", "3", "--checkpoint-dir", str(out / "ckpt"),
           "--checkpoint-every", str(2 * args.window), "--keep-checkpoints", "2",
           "--metrics-file", str(out / "metrics.jsonl")]
    return cmd + ([] if args.foreground else ["--checkpoint-background"])


def _watch(proc: subprocess.Popen, metrics: Path, ckpt: Path,
           load: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """Until the run ends: the unix time each step record appeared, and each checkpoint's latest part write;
    ``load``: the machine's 1-minute load when each step record appeared."""
    seen: dict[int, float] = {}
    written: dict[int, float] = {}
    offset = 0
    while True:
        done = proc.poll() is not None
        if metrics.exists():
            with open(metrics) as fh:
                fh.seek(offset)
                chunk = fh.read()
            complete = chunk[:chunk.rfind("\n") + 1]
            offset += len(complete.encode())
            now = time.time()
            for line in complete.splitlines():
                record = json.loads(line)
                if record.get("event") == "step":
                    seen.setdefault(int(record["step"]), now)
                    load.setdefault(int(record["step"]), os.getloadavg()[0])
        if ckpt.is_dir():
            for path in ckpt.rglob("*"):
                name = path.name
                if name.startswith("step-") and ".part-" in name and path.is_file():  # (the main file: at the commit)
                    try:
                        step = int(name[5:13])
                        written[step] = max(written.get(step, 0.0), path.stat().st_mtime)
                    except (ValueError, OSError):
                        continue
        if done:
            return seen, written
        time.sleep(0.1)


def _pairs(records: list[dict], window: int, steps: int) -> list[dict]:
    """For each checkpoint: the wall seconds of the window after it, against the mean of the windows without a
    checkpoint on either side of it (a load that rises or falls through the run moves both alike); and rank 0's
    CPU seconds (every thread of its process, the writer's too) the same way."""
    steps_ = {int(r["step"]): r for r in records if r.get("event") == "step"}
    out = []
    for at in range(2 * window, steps - 2 * window + 1, 2 * window):  # a checkpoint at each; not the run's last
        marks = [at - window + k * window for k in range(4)]  # [before][with][after]
        if any(m not in steps_ for m in marks):
            continue
        wall = [float(steps_[m]["time_s"]) for m in marks]
        cpu = [float(steps_[m]["cpu_s"]) for m in marks]
        with_, without = wall[2] - wall[1], ((wall[1] - wall[0]) + (wall[3] - wall[2])) / 2
        cpu_with, cpu_without = cpu[2] - cpu[1], ((cpu[1] - cpu[0]) + (cpu[3] - cpu[2])) / 2
        out.append({"checkpoint_at": at, "with_s": round(with_, 3), "without_s": round(without, 3),
                    "before_s": round(wall[1] - wall[0], 3), "after_s": round(wall[3] - wall[2], 3),
                    "cost": round(with_ / without - 1, 4), "cpu_with_s": round(cpu_with, 3),
                    "cpu_without_s": round(cpu_without, 3), "cpu_cost": round(cpu_with / cpu_without - 1, 4)})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=90)
    parser.add_argument("--window", type=int, default=10, help="steps per window (a checkpoint every 2 x this)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--foreground", action="store_true", help="checkpoints in the foreground (no --checkpoint-background)")
    parser.add_argument("--target", type=float, default=0.05)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="polytrain-ckpt-cost-") as tmp:
        out = Path(tmp)
        load_before = os.getloadavg()
        command = _command(args, out)
        print("$ " + " ".join(command[1:]), flush=True)
        proc = subprocess.Popen(command, env=_env(), stdout=open(out / "log", "w"), stderr=subprocess.STDOUT)
        loads: dict[int, float] = {}
        seen, written = _watch(proc, out / "metrics.jsonl", out / "ckpt", loads)
        load_after = os.getloadavg()
        if proc.returncode != 0:
            print((out / "log").read_text()[-3000:])
            print(f"the run failed (exit {proc.returncode})")
            return 1
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in records if r.get("event") == "end")
    pairs = _pairs(records, args.window, args.steps)
    for pair in pairs:  # a write still going when the "without" window began
        wrote = written.get(pair["checkpoint_at"])
        began = seen.get(pair["checkpoint_at"] + args.window)
        pair["spilled"] = bool(wrote and began and wrote > began)
        at = pair["checkpoint_at"]
        window_loads = [loads[s] for s in range(at - args.window, at + 2 * args.window + 1) if s in loads]
        pair["load"] = [round(min(window_loads), 1), round(max(window_loads), 1)] if window_loads else None
        print(f"checkpoint at step {pair['checkpoint_at']}: the {args.window} steps after it {pair['with_s']:.2f} s, "
              f"the {args.window} before and after those without one {pair['before_s']:.2f} s and "
              f"{pair['after_s']:.2f} s: cost {pair['cost']:+.1%}; rank 0's CPU "
              f"{pair['cpu_with_s']:.2f} s against {pair['cpu_without_s']:.2f} s: {pair['cpu_cost']:+.1%}"
              + (" (the write went on into the window without)" if pair["spilled"] else "")
              + (f"; load {pair['load'][0]}-{pair['load'][1]}" if pair["load"] else ""))
    if not pairs:
        print("no pair of windows: give more --steps")
        return 1
    costs = [p["cost"] for p in pairs]
    median = statistics.median(costs)
    step_s = statistics.median(p["without_s"] / args.window for p in pairs)
    print(f"a checkpoint every {args.window} steps costs {median:+.1%} of the step time (median of {len(costs)}; "
          f"{min(costs):+.1%} to {max(costs):+.1%}); {step_s:.2f} s a step without; target <= {args.target:.0%}")
    cpu = [p["cpu_cost"] for p in pairs]
    print(f"rank 0's CPU seconds (every thread, the writer's too): {statistics.median(cpu):+.1%} "
          f"({min(cpu):+.1%} to {max(cpu):+.1%}): what the checkpoints cost whatever else shares the cores")
    stall = end.get("checkpoint_stall_s")
    print(f"checkpoint_stall_s: {stall}")
    if stall:  # what the step itself waited, against the wall of the steps a checkpoint every --window steps spans
        print(f"the step itself held {stall['median']:.2f} s per checkpoint at the median: "
              f"{stall['median'] / (args.window * step_s):.1%} of {args.window} steps; the rest of the cost is the "
              "write beside the training processes")
    print(f"load (1, 5, 15 min): before {tuple(round(x, 2) for x in load_before)}, "
          f"after {tuple(round(x, 2) for x in load_after)}")
    if args.json:
        doc = {"command": "polytrain " + " ".join(command[3:]), "window": args.window, "pairs": pairs,
               "median_cost": round(median, 4), "min_cost": min(costs), "max_cost": max(costs),
               "median_cpu_cost": round(statistics.median(cpu), 4),
               "step_s_without": round(step_s, 3), "checkpoint_stall_s": end.get("checkpoint_stall_s"),
               "load_before": load_before, "load_after": load_after, "target": args.target}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return 0 if median <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
