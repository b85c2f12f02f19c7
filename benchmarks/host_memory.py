"""What ``--host-memory cache`` is worth: single and sync runs with each setting, alternated, paired ratios.

glibc's mmap threshold slides up after the process frees a large block, so whether ``release`` pays page
faults every step depends on what the process freed before training. With a small dataset nothing large
is freed, and it does. This script therefore defaults to 512 synthetic examples, where ``polytrain bench``
uses 4,096 (whose construction frees a 28 MB block and hides the effect).

    python benchmarks/host_memory.py --repeats 5 --json benchmarks/results/host-memory.json

Every run is a fresh process (the setting is C library state that cannot be undone within a process).
Page faults are counted over each whole run, in all its processes, start-up included (``RUSAGE_CHILDREN``).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

from polytrain.bench.cases import BenchConfig, Case, plan
from polytrain.bench.measure import run_case

MODES = ("cache", "release")


def cases(cfg: BenchConfig) -> dict[str, Case]:
    """polytrain bench's own single 1-thread and sync cases."""
    return {case.key: case for case in plan(cfg) if case.key in ("single_1t", "sync")}


def run_isolated(args: argparse.Namespace, key: str, mode: str, repeat: int, tmp: str) -> dict:
    """One run in a fresh process: the malloc setting cannot be undone in a process once applied, and a
    one-worker run would happen in this one."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    cmd = [sys.executable, __file__, "--data", args.data, "--model", args.model, "--workers", str(args.workers),
           "--one", key, mode, str(repeat), tmp]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{key} --host-memory {mode} failed:\n{done.stderr[-3000:]}")
    rate = float(done.stdout.strip().splitlines()[-1])
    return {"examples_per_sec": round(rate, 1),
            "page_faults": resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before}


def measure(args: argparse.Namespace, cfg: BenchConfig) -> dict:
    chosen = cases(cfg)
    runs = {key: {mode: [] for mode in MODES} for key in chosen}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for key, case in chosen.items():
                for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                    run = run_isolated(args, key, mode, repeat, tmp)
                    runs[key][mode].append(run)
                    print(f"repeat {repeat + 1}/{args.repeats} {case.label}, --host-memory {mode}: "
                          f"{run['examples_per_sec']:.1f} examples/s, {run['page_faults']} page faults", flush=True)
    ratios = {}
    for key, case in chosen.items():
        paired = [c["examples_per_sec"] / r["examples_per_sec"] for c, r in zip(runs[key]["cache"], runs[key]["release"])]
        ratios[key] = {"label": case.label, "per_repeat": [round(p, 4) for p in paired],
                       "value": round(statistics.median(paired), 4)}
    return {"config": cfg.to_dict(), "runs": runs, "cache_vs_release": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="synthetic:shape=3x24x24,size=512,test_size=0")
    parser.add_argument("--model", default="cifar_cnn")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the runs and the ratios here")
    parser.add_argument("--one", nargs=4, metavar=("CASE", "MODE", "REPEAT", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cfg = BenchConfig(model=args.model, data=args.data, workers=args.workers)
    cfg.check()
    if args.one:  # a child of run_isolated: one measurement, its rate on the last line
        key, mode, repeat, tmp = args.one
        m = run_case(cases(cfg)[key], replace(cfg, host_memory=mode), int(repeat), Path(tmp))
        print(m.examples_per_sec)
        return
    doc = measure(args, cfg)
    for ratio in doc["cache_vs_release"].values():
        print(f"{ratio['label']}: examples/sec with --host-memory cache / release, median of paired repeats "
              f"{ratio['value']:.3f} ({min(ratio['per_repeat']):.3f}-{max(ratio['per_repeat']):.3f})")
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
