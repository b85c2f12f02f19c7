"""A checkpoint read into what a rank holds, tensor by tensor, each rank reading only its rows: the
``held_state`` capability of a strategy whose ranks' tensors are the run's state itself (``single``, ``sync``: a
whole replica; ``fsdp``, ``tp``: ``DTensor`` shards) and whose optimizer is a ``torch.optim`` optimizer over the
model's parameters in ``single``'s order.

:meth:`HeldState.load` takes a :class:`~polytrain.train.lazy.LazyCheckpoint` (one file written by any strategy,
or the parts a sharded run wrote at any world size, mapped): each parameter and buffer is filled with the
block this rank holds (:mod:`polytrain.weights.fill`), and each optimizer state tensor shaped like its parameter
is read as the same block and placed as the parameter is (a ``DTensor`` of the same placements), so resuming
reads no more than the rank holds, and nothing is broadcast.
"""

from __future__ import annotations

from typing import Any

import torch

from polytrain.weights.fill import check_fits, fill, read_held


class HeldState:
    """What ``strategy`` holds, filled from a checkpoint (see the module docstring)."""

    def __init__(self, strategy: Any, by_rows: bool = True):
        self.strategy = strategy
        #: whether ``--resume`` reads the checkpoint on every rank (each its rows) rather than on rank 0, which
        #: hands it to the others: every rank then reads the checkpoint directory (on several machines, a shared
        #: file system, as fsdp's parts need anyway)
        self.by_rows = by_rows
        #: after :meth:`load`: (bytes this rank read, bytes of the checkpoint's model and optimizer tensors)
        self.read: tuple[int, int] = (0, 0)

    def load(self, checkpoint: Any) -> None:
        s = self.strategy
        assert s.model is not None and s.optimizer is not None
        module = s.module
        check_fits(module, checkpoint.model)
        fill(module, checkpoint.model)
        params = [p for group in s.optimizer.param_groups for p in group["params"]]
        shapes = checkpoint.optimizer.tensors()
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(params):
            per: dict[str, Any] = {}
            for key, value in checkpoint.optimizer_state(index).items():
                if value is not checkpoint.TENSOR:
                    per[key] = value
                    continue
                name = f"{index}/{key}"
                if tuple(shapes[name][0]) == tuple(param.shape) and shapes[name][0]:
                    per[key] = _placed_like(read_held(param, checkpoint.optimizer, name), param)
                else:  # a step count kept as a tensor, or state not shaped like the parameter: whole
                    per[key] = checkpoint.optimizer.read(name)
            if per:
                state[index] = per
        s.optimizer.load_state_dict({"state": state, "param_groups": checkpoint.param_groups})
        whole = sum(torch.Size(shape).numel() * dtype.itemsize for source in (checkpoint.model, checkpoint.optimizer)
                    for shape, dtype in source.tensors().values())
        self.read = (checkpoint.model.bytes_read + checkpoint.optimizer.bytes_read, whole)


def _placed_like(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's block) placed as ``param`` is: a DTensor of its mesh and placements, or as is."""
    if not hasattr(param, "device_mesh"):
        return local.to(param.device)
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(param.to_local().device), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())
