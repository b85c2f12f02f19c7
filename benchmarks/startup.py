"""Start-up against torchrun: ``polytrain train`` (2 workers, sync, a tiny MLP, 2 steps) and ``torchrun`` running
a plain DDP script of the same model and steps, in pairs (the order swapped every pair), on one machine.

Per run: the whole process's wall time (command to exit), the time from the command to the start of the first
step (polytrain: the summary's ``startup_s``, counted from the command's process start; the DDP script: rank 0
notes the time as its first step begins, counted from when the driver started torchrun), and the CPU of the
process tree (user + sys of the command and every process it waited for, as ``getrusage(RUSAGE_CHILDREN)``
counts them).
Prints each pair's ratio polytrain / torchrun and their median and spread, with the machine's load.

    python benchmarks/startup.py --pairs 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

DDP_SCRIPT = '''
import os, sys, time
import torch, torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
for step in range(2):
    if step == 0 and dist.get_rank() == 0:
        with open(sys.argv[1], "w") as fh:
            fh.write(repr(time.time()))
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dist.destroy_process_group()
'''


def _run(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, CPU s of the tree, the time it started)"""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    wall = time.time() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), start


def polytrain_run(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    metrics = tmp / "m.jsonl"
    metrics.unlink(missing_ok=True)
    wall, cpu, start = _run([sys.executable, "-m", "polytrain", "train", "--strategy", "sync", "--workers", "2",
                             "--model", "mlp:hidden=32", "--data", "synthetic", "--steps", "2", "--log-every", "1",
                             "--eval-every", "0", "--progress", "off", "--metrics-file", str(metrics)], env)
    end = next(json.loads(line) for line in metrics.read_text().splitlines() if '"event": "end"' in line)
    return {"wall_s": wall, "cpu_s": cpu, "first_step_s": float(end["startup_s"])}


def torchrun_run(tmp: Path, env: dict[str, str]) -> dict[str, float]:
    script, marker = tmp / "ddp.py", tmp / "first_step"
    script.write_text(DDP_SCRIPT)
    marker.unlink(missing_ok=True)
    wall, cpu, start = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script), str(marker)], env)
    return {"wall_s": wall, "cpu_s": cpu, "first_step_s": float(marker.read_text()) - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1"}
    loads = [os.getloadavg()[0]]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = (polytrain_run, torchrun_run) if pair % 2 == 0 else (torchrun_run, polytrain_run)
            got = {fn.__name__: fn(Path(tmp), env) for fn in order}
            rows.append(got)
            loads.append(os.getloadavg()[0])
            p, t = got["polytrain_run"], got["torchrun_run"]
            print(f"pair {pair}: polytrain wall {p['wall_s']:.2f} s, first step {p['first_step_s']:.2f} s, CPU "
                  f"{p['cpu_s']:.2f} s | torchrun wall {t['wall_s']:.2f} s, first step {t['first_step_s']:.2f} s, "
                  f"CPU {t['cpu_s']:.2f} s", flush=True)
    for key in ("wall_s", "first_step_s", "cpu_s"):
        ratios = [r["polytrain_run"][key] / r["torchrun_run"][key] for r in rows]
        print(f"{key}: polytrain / torchrun median {statistics.median(ratios):.2f} (range {min(ratios):.2f}-"
              f"{max(ratios):.2f}, {len(ratios)} pairs)")
    print(f"load (1 min) during the pairs: {min(loads):.1f}-{max(loads):.1f}")


if __name__ == "__main__":
    main()
