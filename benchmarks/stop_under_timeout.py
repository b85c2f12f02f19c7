"""`timeout` stops `polytrain train` in order: one SIGTERM, delivered twice, counts once.

GNU `timeout` sends its signal to the command and then to the command's whole process group, so the launching
process receives SIGTERM twice within microseconds, and so did, before they had process groups of their own,
the workers and a worker's C++ compiler in the middle of a `--compile`. Each run here is
`timeout --preserve-status SECONDS polytrain train ...` (`--preserve-status`: the command's own exit code, not
timeout's 124) of two cases, REPEATS times each:

* `compile`: 2 sync workers of a 2-block transformer_lm with `--compile`, each run with an empty inductor
  cache, so that the C++ compiler runs when the signal comes (on a loaded 2-core machine the first compile takes
  tens of seconds);
* `checkpoints`: the same model without `--compile`, a checkpoint every step (a signal during a write).

A run passes when it exits 75, its last line names the checkpoint at the stop step (or says it stopped before
training began: nothing to save) and that checkpoint is the directory's latest and whole, and its output holds
no compiler error, no traceback and no "second SIGTERM" / "stopped at once". `--seconds` sets when the signal
comes (one number, or one per case: `--seconds 60,45`); on a loaded machine the start-up alone can take 30 s. Writes a JSON record (default
benchmarks/results/cpu-2core-stop-under-timeout.json).

    python benchmarks/stop_under_timeout.py [--repeats 10] [--seconds 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from polytrain.train.checkpoint import Checkpointer

MODEL = ["--data", "text:seq_len=32", "--model", "transformer_lm:layers=2,dim=64,heads=2", "--batch-size", "8",
         "--steps", "1000000", "--progress", "off", "--eval-every", "0", "--workers", "2", "--log-every", "1"]
CASES = {"compile": ["--compile"], "checkpoints": ["--checkpoint-every", "1"]}
BAD = ("CppCompileError", "InductorError", "Traceback", "second SIGTERM", "stopped at once", "stopping this process at once")


def one(case: str, seconds: float, work: Path) -> dict:
    ckpt = work / "ck"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"))
    started = time.monotonic()
    proc = subprocess.run(["timeout", "--preserve-status", str(seconds), sys.executable, "-m", "polytrain", "train",
                           *MODEL, *CASES[case], "--checkpoint-dir", str(ckpt)], env=env, capture_output=True,
                          text=True)
    took = time.monotonic() - started
    err = proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    stopped = re.search(r"stopped by SIGTERM after step (\d+); checkpoint", last)
    before = "before training began" in last
    step = int(stopped.group(1)) if stopped else None
    latest = Checkpointer(ckpt).latest() if ckpt.exists() else None
    good = Checkpointer(ckpt).choose().good if latest is not None else None
    checkpoint_ok = (step is not None and latest is not None and latest.name == f"step-{step:08d}.pt"
                     and good is not None and good.step == step) or (before and step is None)
    bad = [word for word in BAD if word in err]
    ok = proc.returncode == 75 and checkpoint_ok and not bad
    return {"case": case, "ok": ok, "exit": proc.returncode, "stop_step": step, "before_training": before,
            "latest": latest.name if latest is not None else None, "bad_words": bad, "seconds": round(took, 1),
            "last_line": last, **({"output_tail": err[-2000:]} if not ok else {})}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", default="30", help="seconds until the signal: one, or one per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default="benchmarks/results/cpu-2core-stop-under-timeout.json")
    args = parser.parse_args()
    runs, load_before = [], os.getloadavg()
    cases = args.cases.split(",")
    seconds = [float(s) for s in args.seconds.split(",")]
    seconds = dict(zip(cases, seconds if len(seconds) == len(cases) else seconds[:1] * len(cases)))
    for repeat in range(args.repeats):
        for case in cases:
            with tempfile.TemporaryDirectory(prefix="polytrain-stop-") as d:
                run = one(case, seconds[case], Path(d))
            runs.append(run)
            where = "before training" if run["before_training"] else f"step {run['stop_step']}"
            print(f"{repeat + 1}/{args.repeats} {case}: {'ok' if run['ok'] else 'FAILED'} exit {run['exit']}, "
                  f"stopped {where}, {run['seconds']} s{'' if run['ok'] else ': ' + run['last_line']}", flush=True)
    failed = [run for run in runs if not run["ok"]]
    record = {"seconds": seconds, "repeats": args.repeats, "load_before": load_before,
              "load_after": os.getloadavg(), "passed": len(runs) - len(failed), "runs": runs}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    print(f"{len(runs) - len(failed)} of {len(runs)} runs stopped in order (load {load_before[0]:.1f} -> "
          f"{os.getloadavg()[0]:.1f})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
