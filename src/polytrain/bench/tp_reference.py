"""The yardstick for ``polytrain bench --suite tp``: a plain tensor-parallel training loop with
``torch.distributed.tensor.parallel``.

What a PyTorch user writes from the tensor-parallel tutorial, without polytrain: ``torch.multiprocessing``
starts the workers (forked on Linux, so that none imports torch again; spawned elsewhere), they rendezvous through a ``FileStore`` in a private temporary directory (nothing
listens on the network; gloo is pinned to the loopback interface), each builds the whole model, a 1-D
``DeviceMesh`` of the workers and calls ``parallelize_module`` once with a plan written out by hand (every
block's attention heads and MLP: ``ColwiseParallel`` then ``RowwiseParallel``), then runs zero_grad / forward /
cross-entropy / backward / step on each whole global batch (every tensor-parallel rank takes all of it).

With ``--dp-shard S`` (fsdp x tp, torchtitan's 2-D): ``S x --workers`` processes on a ``dp_shard x tp`` mesh;
the plan is applied over ``tp`` first, then ``fully_shard`` over ``dp_shard`` on every unit of the model and on
the model itself, and each ``dp_shard`` rank takes its slice of the global batch.

Taken from polytrain: the model, its initial values (``build_model(..., seed=S)``), the data and the batch
order, so both sides train the same network on the same batches; and the style of ``transformer_lm``'s fused
q, k, v projection (3 parts, each split alike: :mod:`polytrain.parallel.tp.plan`), which torch has no
name for. Records examples/s over the steps after the warm-up and each timed step's seconds (rank 0's clock).

Run alone::

    python -m polytrain.bench.tp_reference --workers 2 --steps 20 --result tp.json
    python -m polytrain.bench.tp_reference --workers 2 --dp-shard 2 --steps 20 --result fsdp-tp.json
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
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import polytrain.strategies  # noqa: F401  (first: polytrain.parallel.tp imported before it is a circular import)
from polytrain.bench.ddp_reference import cross_entropy, leave_at_once
from polytrain.data.batches import BatchPlan
from polytrain.data.registry import build_data
from polytrain.devices.host_memory import HOST_MEMORY_CHOICES, set_host_memory
from polytrain.distributed.processes import fork_or_spawn
from polytrain.distributed.rendezvous import loopback_interface
from polytrain.models.registry import build_model
from polytrain.parallel.dtensor import full as whole
from polytrain.parallel.tp.plan import Rule, parallel_style


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polytrain.bench.tp_reference",
                                description="Plain tensor-parallel (parallelize_module) training, timed after a "
                                            "warm-up.")
    p.add_argument("--workers", type=int, default=2, help="tensor-parallel ranks")
    p.add_argument("--dp-shard", type=int, default=1, help="ranks each tp group's model is fully_shard-ed over "
                                                           "(fsdp x tp: dp-shard x workers processes)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--model", default="transformer_lm:layers=4,dim=256,heads=4")
    p.add_argument("--data", default="text:seq_len=128")
    p.add_argument("--batch-size", type=int, default=8, help="the global batch (each rank takes all of it)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    p.add_argument("--interval", type=int, default=1, help="the step times and the final loss by intervals of N "
                                                           "steps (the final loss: the last N steps' mean), as "
                                                           "polytrain's log points every N steps report them")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    p.add_argument("--host-memory", choices=HOST_MEMORY_CHOICES, default="release")
    p.add_argument("--result", required=True, help="JSON file for the measurement (written by rank 0)")
    p.add_argument("--save-model", help="write the final whole state_dict here (rank 0)")
    return p.parse_args(argv)


def worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    set_host_memory(args.host_memory)
    torch.set_num_threads(args.threads)
    world = args.workers * args.dp_shard
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.timeout))
    try:
        train(rank, args)
        dist.barrier()  # every rank done with its collectives before any tears the group down
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_at_once()


def hand_written_plan(layers: int) -> dict:
    """Every block's heads (q, k, v colwise, the projection rowwise) and MLP (colwise, rowwise)."""
    plan = {}
    for i in range(layers):
        plan[f"blocks.{i}.attn.qkv"] = parallel_style(Rule("qkv", "colwise", parts=3))
        plan[f"blocks.{i}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
    return plan


def train(rank: int, args: argparse.Namespace) -> None:
    data = build_data(args.data, seed=args.seed)
    mesh = init_device_mesh("cpu", (args.dp_shard, args.workers), mesh_dim_names=("dp_shard", "tp"))
    model = build_model(args.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=args.seed)
    parallelize_module(model, mesh["tp"], hand_written_plan(len(model.blocks)))
    per, row = args.batch_size // args.dp_shard, mesh.get_local_rank("dp_shard")
    if args.dp_shard > 1:  # fsdp x tp: every unit, then the root, sharded over dp_shard
        for unit in (model.embed, *model.blocks, model.head):
            fully_shard(unit, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    plan = BatchPlan(len(data.train), args.batch_size, args.seed)
    ends = []  # the clock at the end of the warm-up and of every timed step
    total, losses = args.warmup + args.steps, []
    for step in range(total):
        if step == args.warmup:
            ends.append(time.perf_counter())
            cpu = time.process_time()
        x, y = data.train.get_batch(plan.global_indices(step)[row * per:(row + 1) * per], plan.position(step)[0])
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step >= total - args.interval:
            losses.append(loss.detach())
        if step >= args.warmup:
            ends.append(time.perf_counter())
    elapsed = ends[-1] - ends[0]
    cpu = time.process_time() - cpu
    full = {k: whole(v) for k, v in model.state_dict().items()}  # (a fused q, k, v over two meshes: in order)
    if rank == 0:
        if args.save_model:
            torch.save(full, args.save_model)
        with open(args.result, "w") as fh:
            json.dump({"examples_per_sec": args.steps * args.batch_size / elapsed, "window_s": elapsed, "cpu_s": cpu,
                       "timed_steps": args.steps, "global_batch": args.batch_size,
                       "step_s": interval_steps(ends, args.warmup, args.interval),
                       "final_loss": torch.stack(losses).mean().item()}, fh)


def interval_steps(ends: list[float], warmup: int, interval: int) -> list[float]:
    """Each interval's mean step time, the intervals ending at the steps polytrain logs at (every ``interval``
    steps and the last); ``ends``: the clock at the end of the warm-up and of every timed step after it."""
    marks = [i for i in range(len(ends)) if (warmup + i) % interval == 0 or i == len(ends) - 1]
    return [(ends[b] - ends[a]) / (b - a) for a, b in zip(marks, marks[1:])]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workers < 2:
        raise SystemExit("--workers must be 2 or more (one rank splits nothing)")
    if args.dp_shard < 1 or args.batch_size % args.dp_shard:
        raise SystemExit(f"--dp-shard {args.dp_shard} must be >= 1 and divide --batch-size {args.batch_size}")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="tp-reference-") as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.workers * args.dp_shard,
                           join=True, start_method=fork_or_spawn())


if __name__ == "__main__":
    main()
