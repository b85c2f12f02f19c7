"""The 62 M-parameter ``transformer_lm`` of docs/fsdp.md under ``fsdp --workers 4 --memory-limit 600MiB``:
trained, stopped by SIGTERM, resumed under the same limit to the bit-identical model, saved and exported within
it (docs/checkpoints.md records the result).

    python benchmarks/fsdp_memory_resume.py --json benchmarks/results/cpu-2core-fsdp-memory-resume.json

Three runs of ``polytrain train`` and one export, each a fresh process:

1. **whole**: ``--steps N`` uninterrupted, ``--save-model DIR`` (a Hugging Face directory, each rank writing its
   own shards);
2. **stopped**: the same command with a checkpoint directory, sent SIGTERM once step ``--stop-after`` is logged;
   it checkpoints (in parts, each rank its rows) at the step the ranks agree on and exits 75;
3. **resumed**: the same command with ``--resume``, under the same limit: each rank reads only its rows of the
   parts, trains to step N and saves the model;
4. **export**: ``polytrain checkpoint export`` of the resumed run's last checkpoint to a Hugging Face
   directory, one tensor at a time, its peak memory measured (``ru_maxrss`` of the child, and its ``VmData``
   growth bounded by running it under ``prlimit --data`` of the same limit above its start).

The whole run's model and the resumed run's are compared tensor by tensor (bit for bit), and the export against
the resumed run's saved model. Each run's summary gives every rank's peak memory. A run over the limit stops
with the limit's one line, so finishing is itself the check that each stayed within it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "transformer_lm:layers=8,dim=800,heads=8"
COMMON = ["--strategy", "fsdp", "--workers", "4", "--model", MODEL, "--data", "text:seq_len=32", "--batch-size", "8",
          "--optimizer", "adam", "--lr", "0.001", "--eval-every", "0", "--log-every", "1", "--progress", "lines",
          "--seed", "3", "--threads-per-worker", "1"]


def polytrain(*args: str, timeout: float, **popen: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "polytrain", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def finish(proc: subprocess.Popen, what: str, timeout: float, allowed: tuple[int, ...] = (0,)) -> str:
    out, _ = proc.communicate(timeout=timeout)
    if proc.returncode not in allowed:
        raise SystemExit(f"{what} exited {proc.returncode}:\n{out[-4000:]}")
    return out


def summary_of(metrics: Path) -> dict:
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return next(r for r in reversed(lines) if r.get("event") == "end")


def steps_logged(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in metrics.read_text().splitlines()
             if '"event": "step"' in line]
    return max(steps, default=0)


def load_dir(directory: Path) -> dict:
    from safetensors.torch import load_file

    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(directory / name))
    return tensors


def watch(proc: subprocess.Popen) -> dict:
    """The most of each memory figure the process reached (its /proc status, read every 50 ms until it exits):
    VmHWM (peak resident), RssAnon (its own memory), RssFile (file pages mapped: the checkpoint's, shared)."""
    most = {"VmHWM": 0, "RssAnon": 0, "RssFile": 0, "VmData": 0}
    start = None
    while proc.poll() is None:
        try:
            status = Path(f"/proc/{proc.pid}/status").read_text()
        except OSError:
            break
        fields = {line.split(":")[0]: int(line.split()[1]) for line in status.splitlines()
                  if line.split(":")[0] in most}
        start = fields.get("VmData") if start is None else start
        for key, value in fields.items():
            most[key] = max(most[key], value)
        time.sleep(0.05)
    return {f"peak_{key}_mib": round(value / 1024, 1) for key, value in most.items()} | \
        {"start_VmData_mib": round((start or 0) / 1024, 1)}


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def peak(summary: dict) -> list:
    return summary.get("rank_peak_memory") or summary.get("rank_memory_peak") or \
        {k: v for k, v in summary.items() if "peak" in k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stop-after", type=int, default=3)
    parser.add_argument("--memory-limit", default="600MiB")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    limit = ["--memory-limit", args.memory_limit]
    results: dict = {"model": MODEL, "steps": args.steps, "memory_limit": args.memory_limit,
                     "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        whole = polytrain("train", *COMMON, *limit, "--steps", str(args.steps), "--save-model", str(work / "whole"),
                          "--metrics-file", str(work / "whole.jsonl"), timeout=args.timeout)
        finish(whole, "the uninterrupted run", args.timeout)
        results["whole"] = {"seconds": round(time.perf_counter() - started, 1), "summary": summary_of(work / "whole.jsonl")}
        print(f"uninterrupted run: {results['whole']['seconds']} s", flush=True)

        run = [*COMMON, *limit, "--steps", str(args.steps), "--checkpoint-dir", str(work / "ck"),
               "--metrics-file", str(work / "run.jsonl")]
        started = time.perf_counter()
        stopped = polytrain("train", *run, timeout=args.timeout)
        while steps_logged(work / "run.jsonl") < args.stop_after and stopped.poll() is None:
            time.sleep(0.5)
        stopped.send_signal(signal.SIGTERM)
        out = finish(stopped, "the stopped run", args.timeout, allowed=(75,))
        results["stopped"] = {"seconds": round(time.perf_counter() - started, 1),
                              "stopped": summary_of(work / "run.jsonl").get("stopped"),
                              "line": next((l for l in out.splitlines() if "stopped" in l), "")}
        print(f"stopped: {results['stopped']['stopped']}", flush=True)

        started = time.perf_counter()
        resumed = polytrain("train", *run, "--resume", "--save-model", str(work / "resumed"), timeout=args.timeout)
        out = finish(resumed, "the resumed run", args.timeout)
        results["resumed"] = {"seconds": round(time.perf_counter() - started, 1),
                              "summary": summary_of(work / "run.jsonl"),
                              "lines": [l for l in out.splitlines() if "resumed" in l or "weights" in l]}
        results["bit_identical"] = same(load_dir(work / "whole"), load_dir(work / "resumed"))
        print(f"resumed to step {args.steps}: the model bit for bit the uninterrupted run's: "
              f"{results['bit_identical']}", flush=True)

        started = time.perf_counter()
        export = polytrain("checkpoint", "export", str(work / "ck"), str(work / "exported"), timeout=args.timeout)
        memory = watch(export)
        out = finish(export, "the export", args.timeout)
        results["export"] = {"seconds": round(time.perf_counter() - started, 1), "line": out.strip().splitlines()[-1],
                             **memory, "equals_saved": same(load_dir(work / "exported"), load_dir(work / "resumed"))}
        print(f"export: {results['export']}", flush=True)
    results["load_after"] = os.getloadavg()
    text = json.dumps(results, indent=2, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
