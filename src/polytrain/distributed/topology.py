"""The one object that says where this process stands: rank, world, device and process group.

It is created once per worker by the launcher and passed explicitly to strategies and the trainer;
polytrain keeps no module-level process-group state. Collectives on it time out (the group's timeout)
and are no-ops in a single process, so the same training code runs with and without a group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    group: Any = None  # torch.distributed.ProcessGroup; None in a single process without a group
    timeout: timedelta = timedelta(minutes=5)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def describe(self) -> str:
        if not self.distributed:
            return f"1 process on {self.device}"
        return (f"{self.world_size} processes ({self.local_world_size} on this machine), "
                f"backend {self.backend}, rank {self.rank} on {self.device}")

    # -- collectives used by the trainer; tensors must be on self.device for NCCL --------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank; on gloo, a rank that does not arrive in time is named in the error."""
        if not self.distributed:
            return
        if self.backend == "gloo":
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=self.group)
