"""The yardstick for ``polytrain bench --suite pipeline``: a plain ``torch.distributed.pipelining`` loop.

What a PyTorch user writes from the pipelining tutorial, without polytrain: ``torch.multiprocessing`` starts
one process per stage (forked on Linux, so that none imports torch again; spawned elsewhere), they rendezvous through a ``FileStore`` in a private temporary directory (nothing
listens on the network; gloo is pinned to the loopback interface), each builds the whole model, keeps its
stage (an ``nn.Sequential`` of the units ``--split-at`` gives it), wraps it in a ``PipelineStage`` and runs the
schedule's ``step`` with a cross-entropy loss (torch's defaults: each micro-batch's mean loss, gradients
scaled by 1/M), then SGD with momentum on its stage's parameters.

Taken from polytrain: the model, its initial values (``build_model(..., seed=S)``), its units (the names
``--split-at`` uses), the data and the batch order, so both sides train the same stages on the same batches.
Records examples/s over the steps after the warm-up and each timed step's seconds (rank 0's clock), and the
last stage's final loss.

Run alone::

    python -m polytrain.bench.pipeline_reference --stages 2 --microbatches 4 --split-at blocks.4 --result p.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.pipelining import PipelineStage

from polytrain.bench.ddp_reference import cross_entropy, leave_at_once
from polytrain.data.batches import BatchPlan
from polytrain.data.registry import build_data
from polytrain.distributed.processes import fork_or_spawn
from polytrain.distributed.rendezvous import loopback_interface
from polytrain.models.parts import units
from polytrain.models.registry import build_model
from polytrain.parallel.pp.plan import torch_schedule_class


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polytrain.bench.pipeline_reference",
                                description="Plain torch.distributed.pipelining training, timed after a warm-up.")
    p.add_argument("--stages", type=int, default=2, help="stage processes")
    p.add_argument("--schedule", default="1f1b", help="a schedule of one stage per rank (gpipe, 1f1b)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--split-at", required=True, help="the units that start stages 1.. (blocks.4, ...)")
    p.add_argument("--model", default="transformer_lm:layers=8,dim=128,heads=4")
    p.add_argument("--data", default="text:seq_len=64")
    p.add_argument("--batch-size", type=int, default=32, help="the global batch")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps after the warm-up")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    p.add_argument("--result", required=True, help="JSON file for the measurement (written by rank 0)")
    return p.parse_args(argv)


def worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, args.stages)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.stages,
                            timeout=timedelta(seconds=args.timeout))
    try:
        train(rank, args)
        dist.barrier()  # every rank done with its sends and receives before any tears the group down
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_at_once()


def train(rank: int, args: argparse.Namespace) -> None:
    data = build_data(args.data, seed=args.seed)
    model = build_model(args.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=args.seed)
    parts = units(model)
    names = [name for name, _ in parts]
    bounds = [0, *(names.index(n) for n in args.split_at.split(",")), len(names)]
    mine = nn.Sequential(*(unit for _, unit in parts[bounds[rank]:bounds[rank + 1]]))
    stage = PipelineStage(mine, rank, args.stages, torch.device("cpu"))
    schedule = torch_schedule_class(args.schedule)(stage, args.microbatches, loss_fn=cross_entropy)
    optimizer = torch.optim.SGD(mine.parameters(), lr=args.lr, momentum=args.momentum)
    plan = BatchPlan(len(data.train), args.batch_size, args.seed)
    first, last = rank == 0, rank == args.stages - 1
    ends, losses = [], []
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            ends.append(time.perf_counter())
            cpu = time.process_time()
        x, y = data.train.get_batch(plan.global_indices(step), plan.position(step)[0])
        optimizer.zero_grad(set_to_none=True)
        losses = []
        schedule.step(*((x,) if first else ()), target=y if last else None, losses=losses if last else None)
        optimizer.step()
        if step >= args.warmup:
            ends.append(time.perf_counter())
    final = [torch.stack(losses).mean().item() if last else None]
    dist.broadcast_object_list(final, src=args.stages - 1)
    if first:
        elapsed = ends[-1] - ends[0]
        cpu = time.process_time() - cpu
        with open(args.result, "w") as fh:
            json.dump({"examples_per_sec": args.steps * args.batch_size / elapsed, "window_s": elapsed, "cpu_s": cpu,
                       "timed_steps": args.steps, "global_batch": args.batch_size,
                       "step_s": [b - a for a, b in zip(ends, ends[1:])], "final_loss": final[0]}, fh)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="pipeline-reference-") as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.stages,
                           join=True, start_method=fork_or_spawn())


if __name__ == "__main__":
    main()
