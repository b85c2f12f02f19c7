"""``sync``: synchronous data parallel over worker processes with DistributedDataParallel.

Every worker holds a full replica. DDP broadcasts rank 0's parameters at wrap time (so all replicas start
equal), then all-reduces gradients in buckets while backward is still running. Each worker computes the
mean loss of its equal slice of the global batch and DDP averages the gradients, which equals the gradient
of the mean loss over the whole global batch: one identical update everywhere, the same as ``single``
on the full batch.

CPU workers on one machine average through shared memory (``polytrain.distributed.shm``) instead of gloo's
loopback TCP unless ``--comm backend`` is given; the choice and its reason are logged at start.

With ``--balance on|auto`` the slices need not be equal: every step each rank reports how long its forward
and backward took, and all ranks move examples from slow workers to fast ones alike
(``polytrain.strategies.balance``); each rank's loss is weighted by its slice, so the update is unchanged.

The bytes each rank exchanges are counted (:mod:`polytrain.strategies.traffic`): every gradient bucket the
comm hook hands over (ring model through the process group; the copies in and out of shared memory through
shm), the balancer's timings, and DDP's per-step broadcast of rank 0's buffers where the model has any.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, ContextManager

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from polytrain.data.batches import Slice
from polytrain.distributed.shm import SharedMemoryAllReduce, ShmPlan, gather_plan
from polytrain.errors import ConfigError
from polytrain.phases import interval, phase
from polytrain.distributed.layout import Layout
from polytrain.strategies.balance import Balancer, BalancePolicy
from polytrain.strategies.base import Strategy, data_slice
from polytrain.strategies.registry import register_strategy
from polytrain.strategies.held import HeldState
from polytrain.strategies.compress import make_hook, parse_compress
from polytrain.strategies.sync_config import SyncConfig, SyncDeclared
from polytrain.strategies.sync_batchnorm import convert_sync_batchnorm


@register_strategy
class SyncDataParallel(SyncDeclared, Strategy):

    def __init__(self, topology: Any, options: SyncConfig | None = None, layout: Layout | None = None):
        super().__init__(topology, options, layout)
        # identical replicas: --save-model DIR writes rank 0's one tensor at a time; a resume reads the checkpoint on
        # rank 0 and hands it to the others (its replicas may run on machines that share no file system)
        self.held_state = HeldState(self, by_rows=False)
        self._last_bucket_ready: float | None = None
        self._waited = 0.0
        self._exchange: SharedMemoryAllReduce | None = None
        self._comm_plan: ShmPlan | None = None
        self._balancer: Balancer | None = None
        self._balance_note = ""
        self._compress_note = ""
        self.compression_state: Any = None  # --compress: the hook's state (PowerSGD's error feedback, statistics)
        self._step_started: float | None = None
        self._compute_end: float | None = None
        self._slice = 0  # examples this rank took in the current step
        self._buffer_bytes = 0  # what DDP broadcasts from rank 0 before each step's first forward
        if self.options.balance != "off":
            self.rebalancing = _Rebalancing(self)

    @classmethod
    def check(cls, layout: Layout, config: Any, model: nn.Module | None) -> None:
        super().check(layout, config, model)
        opts = config.sync
        if opts.compress != "off" and opts.comm == "shm":  # --compress: shm is a memory copy, nothing to save
            raise ConfigError(f"--compress {opts.compress} compresses what the process group's all-reduce sends, "
                              "and --comm shm averages through shared memory instead; pass --comm backend or "
                              "auto, or drop --compress")
        if getattr(getattr(config, "on_failure", None), "on_failure", "stop") == "continue":  # any worker may go
            if opts.comm == "shm":
                raise ConfigError("--on-failure continue: --comm shm cannot be rebuilt over the survivors; use "
                                  "--comm auto or backend")
            if opts.balance != "off":
                raise ConfigError(f"--on-failure continue: --balance {opts.balance} is not supported (the slices "
                                  "are re-cut over the survivors); use --balance off")

    def _wrap(self, model: nn.Module) -> nn.Module:
        opts = self.options
        topo = self.topology
        if opts.sync_batchnorm and topo.distributed:
            model = convert_sync_batchnorm(model, topo.group, cuda=topo.device.type == "cuda")
        model = model.to(topo.device)
        if not topo.distributed:
            return model  # one worker: nothing to synchronise, and DDP would need a group
        # any bucket_cap_mb given, DDP's small first bucket goes too: with 25 a model under 25 MiB is one
        # bucket, exchanged only after backward ends, so pass it only when the user chose one
        buckets = {} if opts.bucket_mb is None else {"bucket_cap_mb": opts.bucket_mb}
        ddp = DistributedDataParallel(
            model,
            device_ids=[topo.device.index] if topo.device.type == "cuda" else None,
            process_group=topo.group,
            find_unused_parameters=opts.find_unused_parameters,
            **buckets,
        )
        self._exchange = self._open_exchange(model)
        compression = parse_compress(opts.compress)
        if compression.kind != "off":  # --compress: the hook compresses, all-reduces and counts the bytes
            self.compression_state, hook = make_hook(compression, self)
            ddp.register_comm_hook(self.compression_state, hook)
            self._compress_note = compression.describe()
        else:
            ddp.register_comm_hook(self, _shm_allreduce if self._exchange else _timed_allreduce)
        if getattr(ddp, "broadcast_buffers", True):  # BatchNorm statistics: rank 0's overwrite the others'
            self._buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
        return ddp

    def _open_exchange(self, model: nn.Module) -> SharedMemoryAllReduce | None:
        """Shared memory for the gradients where the user allows it and it applies; a collective."""
        if self.options.comm == "backend":
            self._comm_plan = ShmPlan(False, "--comm backend")
            return None
        if self.options.compress != "off":
            self._comm_plan = ShmPlan(False, f"--compress {self.options.compress}")
            return None
        if self.layout.expendable:  # --on-failure continue: the exchange is rebuilt over the survivors, which
            self._comm_plan = ShmPlan(False, "--on-failure continue")  # shared memory's segment cannot be
            return None
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self._comm_plan = gather_plan(self.topology, grad_bytes)  # no bucket is larger than all gradients
        if not self._comm_plan.use:
            if self.options.comm == "shm":
                raise ConfigError(f"--comm shm cannot be used: {self._comm_plan.reason}; "
                                  "pass --comm backend or auto")
            return None
        return SharedMemoryAllReduce.open(self.topology, self._comm_plan.chunk_bytes)

    def describe(self) -> str:
        text = super().describe()
        if self._comm_plan is not None:
            text += f", gradients averaged through {self._comm_plan.describe()}"
        if self._compress_note:
            text += f", {self._compress_note}"
        if self._balance_note:
            text += f", {self._balance_note}"
        return text

    def train_step(self, batch: Any, lr: float) -> Any:
        if self._buffer_bytes:
            # DDP broadcasts buffers before the first forward after a synchronised backward: once a step, even
            # with --accumulate (no_sync micro-batches skip it); counted as rank 0 sending to each other rank
            n = self.topology.world_size
            if self.topology.rank == 0:
                self.traffic.add((n - 1) * self._buffer_bytes, 0)
            else:
                self.traffic.add(0, self._buffer_bytes)
        return super().train_step(batch, lr)

    def _slice_at(self, step: int) -> Slice:
        """This rank's slice for the step about to start, after learning how the last one went everywhere."""
        balancer, topo = self._balancer, self.topology
        assert balancer is not None
        if self._step_started is not None:
            seconds = (self._compute_end or time.perf_counter()) - self._step_started
            measured = torch.zeros(topo.world_size, 2, device=topo.device)  # float32: MPS has no float64
            measured[topo.rank, 0] = seconds  # every other rank adds zeros: the sum is exact, the same everywhere
            measured[topo.rank, 1] = self._slice
            with phase("exchange"):
                if self._exchange is not None:
                    self._exchange.start_sum(measured).wait()
                    self.traffic.shm_all_reduce(measured.numel() * measured.element_size(), topo.world_size)
                else:
                    topo.all_reduce_sum(measured)
                    self.traffic.all_reduce(measured.numel() * measured.element_size(), topo.world_size)
            balancer.update([(t, int(n)) for t, n in measured.tolist()])
        self._step_started, self._compute_end = time.perf_counter(), None
        self._slice = balancer.sizes[topo.rank]
        return Slice(topo.rank, topo.world_size, balancer.sizes)

    def _unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    def _grad_sync(self, model: nn.Module, enabled: bool) -> ContextManager[Any]:
        if enabled or not isinstance(model, DistributedDataParallel):
            return contextlib.nullcontext()
        return model.no_sync()

    def _backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if self._last_bucket_ready is not None:
            self._compute_end = self._last_bucket_ready
            # from the moment this rank's last gradient bucket was ready until the averaged gradients
            # arrived, the rank was exchanging gradients or waiting for slower ranks, not computing
            now = time.perf_counter()
            self._waited += now - self._last_bucket_ready
            interval("exchange", self._last_bucket_ready, now)  # --profile: backward's end, DDP's exchange
            self._last_bucket_ready = None

    def _take_wait(self) -> float:
        waited, self._waited = self._waited, 0.0
        return waited


class _Rebalancing:
    """``--balance``: each step's slices sized by the workers' measured speed (:mod:`.balance`)."""

    def __init__(self, strategy: SyncDataParallel):
        self.strategy = strategy

    def slices(self, global_batch: int, accumulate: int, data_workers: int,
               deterministic: bool) -> Slice | Callable[[int], Slice]:
        sync = self.strategy
        wanted, topo = sync.options.balance, sync.topology
        if not topo.distributed:
            return data_slice(sync)
        if data_workers:
            if wanted == "on":
                raise ConfigError(f"--balance on needs batches drawn in the workers themselves, but "
                                  f"--data-workers {data_workers} loads them steps ahead; pass --data-workers 0 "
                                  "or --balance off")
            sync._balance_note = f"equal slices (--data-workers {data_workers} loads batches ahead)"
            return data_slice(sync)
        if wanted == "auto" and (deterministic or topo.device.type != "cpu"):
            why = "--deterministic" if deterministic else f"workers on {topo.device.type}"
            sync._balance_note = f"equal slices ({why}; --balance on to balance)"
            return data_slice(sync)
        sync._balancer = Balancer(global_batch, topo.world_size, BalancePolicy(multiple=accumulate))
        sync._balance_note = "slices balanced by measured speed (--balance)"
        return sync._slice_at


def _timed_allreduce(state, bucket):  # unannotated: DDP rejects annotations other than its own types
    """DDP's default all-reduce (average), noting when this rank's bucket was ready."""
    state._last_bucket_ready = time.perf_counter()
    state.traffic.all_reduce(_nbytes(bucket.buffer()), state.topology.world_size)
    return default_hooks.allreduce_hook(state.topology.group, bucket)


def _shm_allreduce(state, bucket):  # unannotated, as above
    """Average the bucket through shared memory on the exchange's thread, while backward goes on."""
    state._last_bucket_ready = time.perf_counter()
    state.traffic.shm_all_reduce(_nbytes(bucket.buffer()), state.topology.world_size)
    return state._exchange.start_average(bucket.buffer())


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
