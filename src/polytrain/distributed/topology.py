"""The one object that says where this process stands: rank, world, device, process groups and mesh axes.

It is created once per worker by the launcher and passed explicitly to strategies and the trainer;
polytrain keeps no module-level process-group state. Collectives on it time out (the group's timeout)
and are no-ops in a single process, so the same training code runs with and without a group.

A strategy arranges the world into named axes (:meth:`Topology.arranged`), the degrees of the job's layout
(:mod:`polytrain.distributed.layout`): ``dp_replicate``, ``dp_shard``, ``pp`` and ``tp``, on one ``DeviceMesh``
(the axes a layout names; any other has size 1). ``dp`` is the batch axis, dp_replicate x dp_shard (one group
of both where both are larger than 1: the mesh's flattened ``dp``): data slices and the groups that metrics
are reduced over come from it; nothing counts processes for that. Without an arrangement every process is its
own replica (``dp`` = world size).
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.distributed.layout import AXES, BATCH
from polytrain.distributed.lost import LostRanks

_KNOWN_AXES = frozenset(AXES + (BATCH,))  # (asked every step: axis_size("dp") weighs the loss)
#: :meth:`Topology.all_gather_object` gathers objects whose pickle is at most this many bytes in one collective
GATHER_BYTES = 2048
_SIZE_BYTES = 8  # each row's first bytes: the length of its pickle


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
    #: sizes of the named axes, in mesh order (empty: every process its own replica)
    axes: tuple[tuple[str, int], ...] = ()
    mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh over ``axes`` once arranged
    #: the ranks this job may go on without, and those lost (--tolerate-worker-loss); one registry per process,
    #: shared by every view of this topology (``arranged``, ``along``) since they are all copies by ``replace``
    lost: LostRanks = field(default_factory=LostRanks, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

    def describe(self) -> str:
        if not self.distributed:
            return f"1 process on {self.device}"
        layout = " x ".join(f"{name} {size}" for name, size in self.axes if size > 1)
        return (f"{self.world_size} processes ({self.local_world_size} on this machine"
                f"{'; ' + layout if layout and len(self.axes) > 1 else ''}), backend {self.backend}, "
                f"rank {self.rank} on {self.device}")

    # -- named axes --------------------------------------------------------------------------------

    def arranged(self, **sizes: int) -> "Topology":
        """This topology with the world laid out as a mesh of the named axes (``dp_replicate=2, pp=2``; ``dp``
        stands for ``dp_replicate``); a collective in a process group (every rank builds the same mesh). Axes
        not named have size 1."""
        if BATCH in sizes:
            sizes["dp_replicate"] = sizes.pop(BATCH)
        unknown = set(sizes) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; known: {', '.join(AXES)}")
        shape = tuple((name, int(sizes[name])) for name in AXES if name in sizes)
        product = 1
        for _, size in shape:
            product *= size
        if product != self.world_size:
            raise ValueError(f"axes {dict(shape)} hold {product} processes, but the world has {self.world_size}")
        mesh = None
        if self.distributed:
            from torch.distributed.device_mesh import init_device_mesh
            # a 1-D axis spanning the world reuses the world group: DDP and the metrics keep their group
            mesh = init_device_mesh(self.device.type, tuple(size for _, size in shape),
                                    mesh_dim_names=tuple(name for name, _ in shape))
            if sizes.get("dp_replicate", 1) > 1 and sizes.get("dp_shard", 1) > 1:
                mesh["dp_replicate", "dp_shard"]._flatten(BATCH)  # the batch axis: one group of both
        return replace(self, axes=shape, mesh=mesh)

    def axis_size(self, axis: str) -> int:
        self._known(axis)
        if not self.axes:
            return self.world_size if axis in ("dp_replicate", BATCH) else 1
        if axis == BATCH:
            return self.axis_size("dp_replicate") * self.axis_size("dp_shard")
        for name, size in self.axes:
            if name == axis:
                return size
        return 1

    def axis_rank(self, axis: str) -> int:
        """This process's coordinate along ``axis``."""
        self._known(axis)
        if axis == BATCH and self.axes:
            return self.axis_rank("dp_replicate") * self.axis_size("dp_shard") + self.axis_rank("dp_shard")
        if self.mesh is None or axis not in self.mesh.mesh_dim_names:
            return self.rank if axis in ("dp_replicate", BATCH) and not self.axes else 0
        return self.mesh.get_local_rank(axis)

    def axis_group(self, axis: str) -> Any:
        """The process group of the ranks that differ from this one only along ``axis`` (None: alone); for
        ``dp``, along dp_replicate and dp_shard."""
        self._known(axis)
        if axis == BATCH and self.axes:
            replicate, shard = self.axis_size("dp_replicate"), self.axis_size("dp_shard")
            if replicate > 1 and shard > 1:
                return self.mesh.get_group(BATCH) if self.mesh is not None else None
            axis = "dp_shard" if shard > 1 else "dp_replicate"
        if self.mesh is None or axis not in self.mesh.mesh_dim_names:
            return self.group if axis in ("dp_replicate", BATCH) and not self.axes else None
        return self.mesh.get_group(axis)

    def submesh(self, *axes: str) -> Any:
        """The mesh along ``axes`` (those of size 1 left out; one axis where only one is larger), e.g. FSDP's
        ``("dp_replicate", "dp_shard")``: 2-D (HSDP) where both are larger than 1. None: no mesh, or every
        axis of size 1."""
        names = [a for a in axes if self.axis_size(a) > 1 and self.mesh is not None
                 and a in self.mesh.mesh_dim_names]
        if not names:
            return None
        return self.mesh[names[0]] if len(names) == 1 else self.mesh[tuple(names)]

    def along(self, axis: str) -> "Topology":
        """A view of the ranks along ``axis`` as a topology of their own (rank = coordinate), for
        collectives over that axis: e.g. the data-parallel replicas that average metrics."""
        size = self.axis_size(axis)
        group = self.axis_group(axis) if size > 1 else None
        return replace(self, rank=self.axis_rank(axis), world_size=size, group=group, axes=(), mesh=None)

    @staticmethod
    def _known(axis: str) -> None:
        if axis not in _KNOWN_AXES:
            raise ValueError(f"unknown axis '{axis}'; known: {', '.join(AXES + (BATCH,))}")

    # -- collectives used by the trainer; tensors must be on self.device for NCCL --------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over all ranks, in place; returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def all_reduce_min(self, tensor: torch.Tensor) -> torch.Tensor:
        """Minimum of ``tensor`` over all ranks, in place; returns it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.group)
        return tensor

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order. One collective when every rank's pickle fits
        :data:`GATHER_BYTES` (a log point's numbers: a few hundred bytes), where ``dist.all_gather_object`` makes
        two (the sizes, then the bytes); a larger one takes that path after the first (every rank sees the sizes)."""
        if not self.distributed:
            return [obj]
        data = pickle.dumps(obj)
        row = _SIZE_BYTES + GATHER_BYTES
        mine = torch.zeros(row, dtype=torch.uint8)
        mine[:_SIZE_BYTES] = torch.frombuffer(bytearray(len(data).to_bytes(_SIZE_BYTES, "little")), dtype=torch.uint8)
        if len(data) <= GATHER_BYTES:
            mine[_SIZE_BYTES:_SIZE_BYTES + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        device = self.device if self.backend == "nccl" else torch.device("cpu")  # (gloo: host memory)
        gathered = torch.empty(self.world_size * row, dtype=torch.uint8, device=device)
        dist.all_gather(list(gathered.view(self.world_size, row)), mine.to(device), group=self.group)
        rows = gathered.cpu().view(self.world_size, row).numpy()
        sizes = [int.from_bytes(r[:_SIZE_BYTES].tobytes(), "little") for r in rows]
        if max(sizes) > GATHER_BYTES:
            out: list[Any] = [None] * self.world_size
            dist.all_gather_object(out, obj, group=self.group)
            return out
        return [pickle.loads(r[_SIZE_BYTES:_SIZE_BYTES + n].tobytes()) for r, n in zip(rows, sizes)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        # src counts within this topology's group; torch >= 2.4 takes a global rank
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        """Wait for every rank; on gloo, a rank that does not arrive in time is named in the error."""
        if not self.distributed:
            return
        if self.backend == "gloo":
            dist.monitored_barrier(group=self.group, timeout=self.timeout, wait_all_ranks=True)
        else:
            dist.barrier(group=self.group)


def arrange(topology: Topology, layout: Any) -> tuple[Topology, Topology]:
    """This process's ``topology`` laid out as ``layout`` (a :class:`~polytrain.distributed.layout.Layout`)
    says, and the trainer ranks' view of it: a collective over the world (every rank makes the same groups).

    When every rank trains, the world is the mesh of the layout's axes and the trainers are all of it. Else
    the trainer ranks get a group of their own; a rank that does not train (a server, a helper) sees them as a
    group it is not part of (rank 0 of a world of their number, no group: it never reduces with them)."""
    if not topology.distributed:
        return topology, topology
    trainers = layout.trainers
    if len(trainers) == layout.processes:
        arranged = topology.arranged(**dict(layout.axes))
        return arranged, arranged
    group = dist.new_group(list(trainers), timeout=topology.timeout) if len(trainers) > 1 else None
    if topology.rank in trainers:
        view = replace(topology, rank=trainers.index(topology.rank), world_size=len(trainers), group=group)
    else:
        view = replace(topology, rank=0, world_size=len(trainers), group=None)
    return topology, view
