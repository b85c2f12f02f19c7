"""The yardstick for ``polytrain bench``: a plain, hand-written PyTorch DDP training script.

It is what a PyTorch user would write without polytrain: ``torch.multiprocessing`` starts the workers
(forked on Linux, so that none imports torch again; spawned elsewhere), they rendezvous through a ``FileStore`` in a private temporary directory (nothing listens on the
network), gloo is pinned to the loopback interface, each worker wraps the model in
``DistributedDataParallel`` and runs zero_grad / forward / loss / backward / step on its slice of each
global batch, gathered from the in-memory dataset in one indexing op.

Only the model, the data and the batch order (``BatchPlan``: which examples form each global batch, and
each worker's slice) are taken from polytrain, so that both sides train the same network on the same
batches: with the same seed they do exactly the same steps (a test checks the final parameters agree).

Run alone::

    python -m polytrain.bench.ddp_reference --workers 2 --steps 30 --result ddp.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from polytrain.data.batches import BatchPlan, Slice
from polytrain.data.registry import build_data
from polytrain.devices.host_memory import HOST_MEMORY_CHOICES, set_host_memory
from polytrain.distributed.processes import fork_or_spawn
from polytrain.distributed.rendezvous import loopback_interface
from polytrain.models.registry import build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m polytrain.bench.ddp_reference",
                                description="Plain PyTorch DDP training, timed after a warm-up.")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per worker")
    p.add_argument("--model", default="cifar_cnn")
    p.add_argument("--data", default="synthetic:shape=3x24x24,size=4096,test_size=0")
    p.add_argument("--worker-batch-size", type=int, default=64)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--steps", type=int, default=30, help="timed steps after the warm-up")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    p.add_argument("--host-memory", choices=HOST_MEMORY_CHOICES, default="release",
                   help="freed tensor memory: release (glibc's default, what a plain script gets) or cache "
                        "(kept for reuse, as polytrain does by default)")
    p.add_argument("--result", required=True, help="JSON file for rank 0's measurement")
    p.add_argument("--save-model", help="write the final state_dict here")
    p.add_argument("--no-sync", action="store_true",
                   help="never exchange gradients (DDP's no_sync): what N workers compute when nothing is "
                        "communicated, the ceiling for any data-parallel training on this machine")
    return p.parse_args(argv)


def worker(rank: int, args: argparse.Namespace, store_path: str) -> None:
    set_host_memory(args.host_memory)
    torch.set_num_threads(args.threads)
    timeout = timedelta(seconds=args.timeout)
    store = dist.FileStore(store_path, args.workers)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.workers, timeout=timeout)
    try:
        train(rank, args)
        dist.barrier()  # every rank done with its collectives before any leaves
    except BaseException:
        dist.destroy_process_group()
        raise
    leave_at_once()


def leave_at_once() -> None:
    """End a worker whose results are written without tearing gloo down: at interpreter exit its threads
    sometimes abort the process ("terminate called without an active exception", SIGABRT, about one run in
    twenty on 2 loaded cores), which would fail a measurement already taken."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def train(rank: int, args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    data = build_data(args.data, seed=args.seed)
    if not hasattr(data.train, "get_batch"):
        raise SystemExit(f"--data {args.data}: the DDP reference needs a dataset that gathers a batch in one "
                         "op (get_batch): digits, synthetic or cifar10")
    if data.task not in ("classification", "lm"):
        raise SystemExit(f"--data {args.data}: the DDP reference trains classifiers and language models "
                         "(cross-entropy) only")
    model = build_model(args.model, input_shape=data.input_shape, num_classes=data.num_outputs, seed=args.seed)
    model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    global_batch = args.worker_batch_size * args.workers
    plan, shard = BatchPlan(len(data.train), global_batch, args.seed), Slice(rank, args.workers)
    total = args.warmup + args.steps
    started = cpu = 0.0
    for step in range(total):
        if step == args.warmup:
            started, cpu = time.perf_counter(), time.process_time()
        x, y = data.train.get_batch(shard.take(plan.global_indices(step)), plan.position(step)[0])
        optimizer.zero_grad(set_to_none=True)
        with model.no_sync() if args.no_sync else contextlib.nullcontext():
            loss = cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
    if rank == 0:
        if args.save_model:
            torch.save(model.module.state_dict(), args.save_model)
        with open(args.result, "w") as fh:
            json.dump({"examples_per_sec": args.steps * global_batch / elapsed, "window_s": elapsed, "cpu_s": cpu,
                       "timed_steps": args.steps, "global_batch": global_batch, "final_loss": loss.item()}, fh)


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a user writes: over classes, or for a language model's (batch, time, vocabulary) outputs the
    mean over the batch's real (not padded, -100) target tokens. Fixed-length windows (``text``) give every
    worker the same number of tokens, so averaging the workers' gradients is the global token mean, as in
    polytrain; for sentences of different lengths it is not (polytrain weighs slices by tokens), which does
    not matter for timing."""
    if outputs.dim() == 3:
        return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1), ignore_index=-100)
    return F.cross_entropy(outputs, targets)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="ddp-reference-") as tmp:
        mp.start_processes(worker, args=(args, os.path.join(tmp, "store")), nprocs=args.workers,
                           join=True, start_method=fork_or_spawn())


if __name__ == "__main__":
    main()
