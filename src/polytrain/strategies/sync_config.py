"""``sync``'s settings (``--comm``, ``--balance``, ``--compress``, ...) and ``sync`` as declared
(:mod:`polytrain.strategies.declared`): imported by the command line without :mod:`polytrain.strategies.sync`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.options import option, register_section
from polytrain.strategies.compress import CHOICES as COMPRESS_CHOICES, check_compress
from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare, mesh_layout
from polytrain.strategies.traits import Traits

COMM_CHOICES = ("auto", "shm", "backend")
BALANCE_CHOICES = ("auto", "on", "off")


@register_section("sync", "strategy sync", order=70)
@dataclass
class SyncConfig:
    sync_batchnorm: bool = option(False, "sync: BatchNorm statistics over the global batch (SyncBatchNorm)")
    bucket_mb: float | None = option(None, "sync: gradient all-reduce bucket size in MiB (default: DDP's own, "
                                           "25 MiB after a first bucket of 1 MiB)", minimum=0.1, metavar="MB")
    find_unused_parameters: bool = option(False, "sync: allow parameters that get no gradient in a step")
    comm: str = option("auto", "sync: how gradients are averaged: shm (shared memory between CPU workers on "
                               "one machine), backend (the process group's all-reduce: gloo or NCCL), or auto "
                               "(shm where it applies)", choices=COMM_CHOICES)
    balance: str = option("off", "sync: split each global batch by the workers' measured speed, so that a "
                                 "slow worker gets fewer examples and the others do not wait (the same update, "
                                 "but runs are no longer bitwise repeatable): off (equal slices), on, or auto "
                                 "(on for CPU workers, unless --deterministic)", choices=BALANCE_CHOICES)
    compress: str = option("off", "sync: compress gradients before the all-reduce (DDP communication hooks): "
                                  "fp16 or bf16 (half the bytes), powersgd:rank=R[:start=S] (rank-R PowerSGD "
                                  "with error feedback, whole gradients for the first S steps, default 2), or "
                                  "off; goes through the process group's all-reduce (--comm backend)",
                           metavar=COMPRESS_CHOICES.replace(", ", "|"), check=check_compress)


@declare
class SyncDeclared(Declared):
    name = "sync"
    summary = "synchronous data parallel: each worker a slice of the global batch, gradients all-reduced"
    config_section = "sync"
    # --on-failure continue: every rank a whole replica
    traits = Traits(exchange="sync", meeting="gradients averaged every step", lost_worker=None)

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        return mesh_layout(cls, workers, options)
