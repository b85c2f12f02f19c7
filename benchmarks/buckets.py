"""One gradient bucket after backward against DDP's own bucket layout, measured inside one run.

Two sync workers hold three replicas of the bench's model: DDP with one bucket (``--bucket-mb 25``: the
whole CIFAR CNN, exchanged when backward ends), DDP with its own layout (the classifier's 3.8 MB bucket goes
out while the convolutions' backward runs; polytrain's default) and the first replica inside ``no_sync()``
(no exchange: the ceiling). Both are polytrain's sync strategy as shipped (``--bucket-mb 25`` and the
default), so both exchanges go through its shared memory, as on any CPU run.
The replicas take turns in blocks of ``--block`` steps, the order of the first two swapped every round, and
each round gives one ratio per replica: its mean step time over the no-exchange one's, the first two steps
of each block left out as the switch's transition.

    python benchmarks/buckets.py --rounds 50 --block 8 --json benchmarks/results/cpu-2core-buckets.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from polytrain.bench.cases import BenchConfig
from polytrain.distributed.launch import launch
from polytrain.models.registry import build_model
from polytrain.strategies.sync import SyncConfig, SyncDataParallel

ONE, LAYOUT, NONE = "one bucket", "DDP's layout", "no exchange"
SKIP = 2  # steps at the start of a block: the ranks realign after the no-exchange block


def replicas(ctx, model: torch.nn.Module) -> dict[str, tuple[SyncDataParallel, DistributedDataParallel]]:
    """The sync strategy as shipped, wrapping a copy of ``model`` with one bucket and with DDP's layout."""
    built = {}
    for key, options in ((ONE, SyncConfig(bucket_mb=25.0)), (LAYOUT, SyncConfig())):
        strategy = SyncDataParallel(ctx.topology, options)
        built[key] = (strategy, strategy.prepare_model(copy.deepcopy(model)))
    built[NONE] = built[ONE]
    return built


def step(strategy: SyncDataParallel, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, x, y,
         exchange: bool) -> float:
    started = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    with strategy.grad_sync(ddp, enabled=exchange):
        strategy.backward(F.cross_entropy(ddp(x), y))
    optimizer.step()
    return time.perf_counter() - started


def alternate(ctx, rounds: int, block: int) -> list[dict[str, float]]:
    bench = BenchConfig()
    torch.manual_seed(bench.seed)
    models = replicas(ctx, build_model(bench.model, input_shape=(3, 24, 24), num_classes=10))
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=bench.lr, momentum=bench.momentum)
                  for k, (_, m) in models.items()}
    gen = torch.Generator().manual_seed(ctx.rank)
    batches = [(torch.randn(bench.worker_batch_size, 3, 24, 24, generator=gen),
                torch.randint(0, 10, (bench.worker_batch_size,), generator=gen)) for _ in range(8)]
    per_round, done = [], 0
    for index in range(rounds + 1):  # round 0 is warm-up
        order = [ONE, LAYOUT, NONE] if index % 2 else [LAYOUT, ONE, NONE]
        means = {}
        for key in order:
            times = []
            for _ in range(block):
                x, y = batches[done % len(batches)]
                times.append(step(*models[key], optimizers[key], x, y, exchange=key != NONE))
                done += 1
            means[key] = statistics.mean(times[SKIP:])
        ctx.topology.all_reduce_sum(torch.zeros(1))  # realign the ranks before the next round
        if index:
            per_round.append({key: means[key] / means[NONE] for key in (ONE, LAYOUT)})
    return per_round


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--json", help="write the per-round ratios and their medians here")
    args = parser.parse_args()
    rank0 = launch(alternate, args.rounds, args.block, workers=2, threads_per_worker=1)[0]
    layout_vs_one = [r[LAYOUT] / r[ONE] for r in rank0]
    summary = {"rounds": args.rounds, "block": args.block,
               "one_bucket_vs_no_exchange": round(statistics.median(r[ONE] for r in rank0), 4),
               "layout_vs_no_exchange": round(statistics.median(r[LAYOUT] for r in rank0), 4),
               "layout_vs_one_bucket": round(statistics.median(layout_vs_one), 4),
               "layout_faster_in": sum(v < 1 for v in layout_vs_one), "per_round": rank0}
    print(f"step time over no exchange, median of {args.rounds} rounds: one bucket "
          f"{summary['one_bucket_vs_no_exchange']:.3f}, DDP's layout {summary['layout_vs_no_exchange']:.3f}; "
          f"layout / one bucket {summary['layout_vs_one_bucket']:.3f}, layout faster in "
          f"{summary['layout_faster_in']} of {args.rounds}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
