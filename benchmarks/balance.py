"""What ``--balance`` is worth, measured inside one run so that the machine's drift cancels out.

Separate runs of balanced and equal slices differ by more than balancing can gain: a shared machine's
quiet and busy minutes move whole runs by ±10 %. Here two sync workers train the bench's model and data
and switch every ``--block`` steps between the balanced split and equal slices (the balancer keeps
learning the workers' speeds throughout); each pair of neighbouring blocks gives one ratio, equal / balanced
step time, the first two steps of each block left out as the switch's transition.

    python benchmarks/balance.py --steps 400 --block 10 --json benchmarks/results/cpu-2core-balance.json

It swaps the trainer's per-step slice function for one that hands out equal slices in every other block,
which reaches into the sync strategy's private state; it is a measurement tool, not an example.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from polytrain.bench.cases import BenchConfig
from polytrain.config import make_config
from polytrain.data.batches import Slice
from polytrain.distributed.launch import launch
from polytrain.train.trainer import Trainer


def train_alternating(ctx, steps: int, block: int, metrics: str) -> None:
    bench = BenchConfig()
    cfg = make_config(model=bench.model, data=bench.data, strategy="sync", balance="on", optimizer="sgd",
                      lr=bench.lr, momentum=bench.momentum, worker_batch_size=bench.worker_batch_size,
                      steps=steps, log_every=1, eval_every=0, histogram_every=0, progress="off",
                      metrics_file=metrics)
    trainer = Trainer(cfg, ctx.topology)
    strategy, balanced = trainer.s.strategy, trainer.s.step_slices

    def slice_at(step: int) -> Slice:
        shard = balanced(step)  # always: the step times are shared and the balancer learns every step
        if (step // block) % 2 == 0:
            strategy._slice = bench.worker_batch_size  # what this rank really takes, for the next report
            return Slice(ctx.rank, ctx.world_size)
        return shard

    trainer.s.step_slices = slice_at
    trainer.fit()


def block_ratios(step_seconds: dict[int, float], block: int, skip: int = 2) -> list[float]:
    """equal / balanced mean step time for each (equal block, following balanced block) pair."""
    ratios = []
    last = max(step_seconds)
    for start in range(2 * block, last - 2 * block + 1, 2 * block):  # the first pair is warm-up
        equal = [step_seconds[s] for s in range(start + skip, start + block)]
        balanced = [step_seconds[s] for s in range(start + block + skip, start + 2 * block)]
        ratios.append(statistics.mean(equal) / statistics.mean(balanced))
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the step times and ratios here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        launch(train_alternating, args.steps, args.block, str(metrics), workers=args.workers, threads_per_worker=1)
        records = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"]
    ends = {r["step"]: r["time_s"] for r in records}
    step_seconds = {s - 1: ends[s] - ends[s - 1] for s in range(2, args.steps + 1)}  # keyed by 0-based step
    ratios = block_ratios(step_seconds, args.block)
    summary = {"steps": args.steps, "block": args.block, "workers": args.workers, "pairs": len(ratios),
               "median_ratio": round(statistics.median(ratios), 4), "mean_ratio": round(statistics.mean(ratios), 4),
               "balanced_faster_in": sum(r > 1 for r in ratios), "ratios": [round(r, 4) for r in ratios]}
    print(f"equal / balanced step time over {len(ratios)} block pairs: median {summary['median_ratio']:.3f}, "
          f"mean {summary['mean_ratio']:.3f}; balanced faster in {summary['balanced_faster_in']} of {len(ratios)}")
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "step_seconds": step_seconds,
                                               "rank_batch": [r["rank_batch"] for r in records]}, indent=1))


if __name__ == "__main__":
    main()
