"""The yardstick for ``polytrain bench --suite fsdp``: a plain, hand-written PyTorch FSDP2 training loop.

What a PyTorch user writes from the FSDP2 tutorial, without polytrain: ``torch.multiprocessing`` starts the
workers (forked on Linux, so that none imports torch again; spawned elsewhere), they rendezvous through a ``FileStore`` in a private temporary directory (nothing listens on the
network; gloo is pinned to the loopback interface), each worker builds a 1-D ``DeviceMesh`` of the workers,
calls ``fully_shard`` on every unit of the model and then on the model itself, and runs zero_grad / forward /
cross-entropy / backward / step on its slice of each global batch.

Only the model, its initial values, the data and the batch order are taken from polytrain
(``build_model(..., seed=S)`` gives the values a polytrain run of ``--seed S`` starts from; ``BatchPlan`` and
``Slice`` say which examples form each global batch and each worker's slice), so that both sides train the
same network on the same batches: with the same seed they take the same steps (a test checks that the final
weights agree). The units sharded are :func:`polytrain.models.parts.units` (the top-level children, a
``ModuleList`` flattened), which is how FSDP2's documentation wraps a transformer: each block, then the root.

Besides the speed (examples/s over the steps after the warm-up, and each timed step's seconds, rank 0's wall
clock) it records each rank's resident memory at the start of training and its peak from there and the bytes of the parameters, gradients and optimizer
state the rank holds at the end (a sharded tensor's local shard), counted as polytrain counts them
(:mod:`polytrain.train.memory`).

Run alone::

    python -m polytrain.bench.fsdp_reference --workers 2 --steps 20 --result fsdp.json
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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from polytrain.bench.ddp_reference import cross_entropy, leave_at_once
from polytrain.data.batches import BatchPlan, Slice
from polytrain.data.registry import build_data
from polytrain.devices.host_memory import HOST_MEMORY_CHOICES, set_host_memory
from polytrain.distributed.processes import fork_or_spawn
from polytrain.distributed.rendezvous import loopback_interface
from polytrain.models.parts import units
from polytrain.models.registry import build_model
from polytrain.train.memory import peak_bytes, reset_peak, state_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polytrain.bench.fsdp_reference",
                                description="Plain PyTorch FSDP2 (fully_shard) training, timed after a warm-up.")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--model", default="transformer_lm:layers=4,dim=256,heads=4")
    p.add_argument("--data", default="text:seq_len=128")
    p.add_argument("--worker-batch-size", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--steps", type=int, default=20, help="timed steps after the warm-up")
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.9, help="sgd's momentum")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="keep each unit's gathered parameters from its forward to its backward")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    p.add_argument("--host-memory", choices=HOST_MEMORY_CHOICES, default="release",
                   help="freed tensor memory: release (glibc's default, what a plain script gets) or cache "
                        "(kept for reuse, as polytrain does by default)")
    p.add_argument("--result", required=True, help="JSON file for the measurement (written by rank 0)")
    p.add_argument("--save-model", help="write the final full state_dict here (rank 0)")
    return p.parse_args(argv)


def worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    set_host_memory(args.host_memory)
    torch.set_num_threads(args.threads)
    store = dist.FileStore(store_path, args.workers)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.workers,
                            timeout=timedelta(seconds=args.timeout))
    try:
        train(rank, args)
        dist.barrier()  # every rank done with its collectives before any tears the group down
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_at_once()


def train(rank: int, args: argparse.Namespace) -> None:
    reset_peak(torch.device("cpu"))  # this rank's peak from here on, as polytrain's trainer measures its own
    start_rss = resident_bytes()
    data = build_data(args.data, seed=args.seed)
    if not hasattr(data.train, "get_batch") or data.task not in ("classification", "lm"):
        raise SystemExit(f"--data {args.data}: the FSDP reference trains classifiers and language models "
                         "(cross-entropy) on a dataset that gathers a batch in one op (get_batch)")
    mesh = init_device_mesh("cpu", (args.workers,), mesh_dim_names=("dp",))
    model = build_model(args.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=args.seed)
    for _, unit in units(model):
        if any(p.requires_grad for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=args.reshard_after_forward)
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)

    global_batch = args.worker_batch_size * args.workers
    plan, shard = BatchPlan(len(data.train), global_batch, args.seed), Slice(rank, args.workers)
    ends = []  # the clock at the end of the warm-up and of every timed step
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            ends.append(time.perf_counter())
            cpu = time.process_time()
        x, y = data.train.get_batch(shard.take(plan.global_indices(step)), plan.position(step)[0])
        optimizer.zero_grad(set_to_none=True)
        loss = cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if step >= args.warmup:
            ends.append(time.perf_counter())
    elapsed = ends[-1] - ends[0]
    cpu = time.process_time() - cpu

    state = state_bytes(model, [optimizer])
    mine = {"start_rss": start_rss, "peak": peak_bytes(torch.device("cpu")), "parameters": state.parameters,
            "gradients": state.gradients, "optimizer": state.optimizer}
    ranks: list = [None] * args.workers
    dist.all_gather_object(ranks, mine)
    losses: list = [None] * args.workers
    dist.all_gather_object(losses, loss.item())
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        if args.save_model:
            torch.save(full, args.save_model)
        with open(args.result, "w") as fh:
            json.dump({"examples_per_sec": args.steps * global_batch / elapsed, "window_s": elapsed, "cpu_s": cpu,
                       "timed_steps": args.steps, "global_batch": global_batch,
                       "step_s": [b - a for a, b in zip(ends, ends[1:])],
                       "final_loss": sum(losses) / len(losses), "rank_memory_bytes": ranks}, fh)


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux; None elsewhere): what it holds before training starts
    (Python, torch and the libraries it loaded), under the peak."""
    try:
        with open("/proc/self/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))
    except (OSError, StopIteration, ValueError):
        return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.workers < 2:
        raise SystemExit("--workers must be 2 or more (one worker shards nothing)")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="fsdp-reference-") as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.workers,
                           join=True, start_method=fork_or_spawn())


if __name__ == "__main__":
    main()
