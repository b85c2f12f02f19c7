"""``sync``: synchronous data parallel over worker processes with DistributedDataParallel.

Every worker holds a full replica. DDP broadcasts rank 0's parameters at wrap time (so all replicas start
equal), then all-reduces gradients in buckets while backward is still running. Each worker computes the
mean loss of its equal slice of the global batch and DDP averages the gradients, which equals the gradient
of the mean loss over the whole global batch: one identical update everywhere, the same as ``single``
on the full batch.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from polytrain.data.batches import Shard
from polytrain.errors import ConfigError
from polytrain.options import option
from polytrain.strategies.base import Strategy, register_strategy
from polytrain.strategies.sync_batchnorm import convert_sync_batchnorm


@dataclass
class SyncConfig:
    sync_batchnorm: bool = option(False, "sync: BatchNorm statistics over the global batch (SyncBatchNorm)")
    bucket_mb: float = option(25.0, "sync: gradient all-reduce bucket size in MiB", minimum=0.1, metavar="MB")
    find_unused_parameters: bool = option(False, "sync: allow parameters that get no gradient in a step")


@register_strategy
class SyncDataParallel(Strategy):
    name = "sync"
    summary = "synchronous data parallel: each worker a slice of the global batch, gradients all-reduced"
    multiprocess = True
    config_section = "sync"

    def __init__(self, topology: Any, options: SyncConfig | None = None):
        super().__init__(topology, options or SyncConfig())
        self._last_bucket_ready: float | None = None
        self._waited = 0.0

    @classmethod
    def check(cls, workers: int, global_batch: int, accumulate: int) -> None:
        if global_batch % workers:
            raise ConfigError(
                f"--batch-size {global_batch} does not divide over {workers} workers; pass a multiple of "
                f"{workers}, or --worker-batch-size B for B examples per worker"
            )
        super().check(workers, global_batch, accumulate)

    def data_shard(self) -> Shard:
        return Shard(self.topology.rank, self.topology.world_size)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        opts = self.options
        topo = self.topology
        if opts.sync_batchnorm and topo.distributed:
            model = convert_sync_batchnorm(model, topo.group, cuda=topo.device.type == "cuda")
        model = model.to(topo.device)
        if not topo.distributed:
            return model  # one worker: nothing to synchronise, and DDP would need a group
        ddp = DistributedDataParallel(
            model,
            device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
            process_group=topo.group,
            bucket_cap_mb=opts.bucket_mb,
            find_unused_parameters=opts.find_unused_parameters,
        )
        ddp.register_comm_hook(self, _timed_allreduce)
        return ddp

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        if enabled or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._last_bucket_ready is not None:
            # from the moment this rank's last gradient bucket was ready until the averaged gradients
            # arrived, the rank was exchanging gradients or waiting for slower ranks, not computing
            self._waited += time.perf_counter() - self._last_bucket_ready
            self._last_bucket_ready = None

    def take_wait_seconds(self) -> float:
        waited, self._waited = self._waited, 0.0
        return waited


def _timed_allreduce(state, bucket):  # unannotated: DDP rejects annotations other than its own types
    """DDP's default all-reduce (average), noting when this rank's bucket was ready."""
    state._last_bucket_ready = time.perf_counter()
    return default_hooks.allreduce_hook(state.topology.group, bucket)
