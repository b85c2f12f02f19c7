"""``--on-failure continue`` over shards (``fsdp --dp-replicate R --dp-shard S``, HSDP, R >= 2): the survivors of a
lost rank put the whole state together from each other's shards, without a restart and without reading a
checkpoint.

Every rank of one shard index (one in each replica) holds the same rows of every parameter and of its optimizer
state. At a membership change each member that trained before hands in its *piece* (:meth:`Healing.piece`): its
rows of the committed state (each ``DTensor``'s local rows, copied to plain tensors) with its shard index and the
shard count, made before the old group goes (no collective). Over the new group (:func:`heal`):

1. every member says which piece it holds (its committed step, shard index and count; a replacement: none), in
   one ``all_gather_object`` of three numbers;
2. the step to continue from is the most advanced committed one (:attr:`Generation.step`), and each shard index's
   source is the lowest rank holding it at that step (:func:`sources`). A shard index no survivor holds (every
   replica's rank of it lost), or holds only as it was before the step in flight (completed by some ranks whose
   peers of that index were lost), is one line, :class:`~polytrain.errors.StateLost`, on every member alike: the
   job ends, and its last checkpoint stands;
3. each source broadcasts its piece in turn, and every member joins each tensor's rows in shard order into the
   whole state as ``single`` saves it (:func:`join`), and loads it into the strategy as a resume does, each rank
   keeping its own rows. The strategy was built over the new layout before (the new group's collectives in the
   order a replacement makes them: its build, then the heal), as at a start, around a plain copy of the model
   whose parameters are made uninitialised (:meth:`Healing.module`).

Memory: while it heals, each member holds the whole model and optimizer state once, plus the pieces it received
and the uninitialised whole model it was built around (together up to about three times the whole state, on the
host), freed before training goes on.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polytrain.errors import StateLost
from polytrain.train.background import copy_state


#: set on a model :meth:`Healing.module` made: built whole on purpose (the start-up's warning is not repeated)
HEALED_ATTR = "_polytrain_healed"


@dataclass(frozen=True)
class Rows:
    """One shard index's rows of a tensor sharded on its first dimension; ``shape``: the whole tensor's."""

    rows: torch.Tensor
    shape: tuple[int, ...]


class Healing:
    """``fsdp``'s ``healing`` capability under ``--on-failure continue``: this rank's shard coordinates, and a
    copy of the model as it came to ``prepare`` whose parameters are on the meta device (no memory) and whose
    buffers are copies, to build the strategy again around the whole state (:meth:`module`)."""

    def __init__(self, model: nn.Module, layout: Any, rank: int):
        self.index, self.count = layout.coordinates(rank).get("dp_shard", 0), layout.axis("dp_shard")
        from polytrain.models.deferred import weights_of

        memo: dict[int, Any] = {id(b): b.detach().clone() for b in model.buffers()}
        source = weights_of(model)  # (a model filled from a file as it is made: the file is shared, not copied)
        if source is not None:
            memo[id(source)] = source
        memo.update({id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
                     for p in model.parameters()})
        self._skeleton = copy.deepcopy(model, memo)

    def piece(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the strategy's local state, live tensors) copied, each ``DTensor`` as this rank's rows
        (:class:`Rows`), with this rank's shard index and the shard count. No collective."""
        return {"index": self.index, "count": self.count, "state": _rows(state)}

    def module(self) -> nn.Module:
        """The plain model as it came to ``prepare``, its parameters made on the host and left uninitialised (the
        whole state is loaded into the strategy built around it), its buffers the copy's."""
        model = copy.deepcopy(self._skeleton)
        made: dict[int, nn.Parameter] = {}
        for name, param in model.named_parameters(remove_duplicate=False):  # (a tied tensor: one parameter)
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, made[id(param)])
        setattr(model, HEALED_ATTR, True)
        return model


def heal(members: Any, step: int, committed: int | None, mine: dict[str, Any] | None) -> dict[str, Any]:
    """The whole state at ``step``, from the members' pieces over the new group (``members``: its topology);
    ``committed`` and ``mine``: this member's committed step and piece (None, None: a replacement)."""
    held = members.all_gather_object(None if mine is None else (committed, mine["index"], mine["count"]))
    parts = [members.broadcast_object(mine if members.rank == rank else None, rank) for rank in sources(held, step)]
    return join(parts)


def sources(held: list[tuple[int, int, int] | None], step: int) -> list[int]:
    """For each shard index in order, the lowest rank holding it at ``step``; ``held``: each rank's (committed
    step, shard index, shard count), or None. :class:`StateLost` where a shard index has no such holder."""
    count = max(h[2] for h in held if h is not None)
    out = []
    for index in range(count):
        holders = [(rank, h[0]) for rank, h in enumerate(held) if h is not None and h[1] == index]
        if not holders:
            raise StateLost(f"--on-failure continue: every worker holding shard {index} of {count} of the model and "
                            "optimizer was lost (no replica of it is left); the job ends here and its last "
                            "checkpoint stands (resume from it; --dp-replicate 2 or more keeps each shard on "
                            "several workers)")
        at = [rank for rank, done in holders if done == step]
        if not at:
            raise StateLost(f"--on-failure continue: step {step} was completed by some workers, but shard {index} "
                            f"of {count} survives only as it was before it (its workers that completed it were "
                            "lost); the job ends here and its last checkpoint stands (resume from it)")
        out.append(min(at))
    return out


def join(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole state from the pieces of shard indices 0, 1, ... in order: each sharded tensor's rows joined,
    anything else the first piece's."""
    def whole(values: list[Any]) -> Any:
        first = values[0]
        if isinstance(first, Rows):
            joined = torch.cat([v.rows for v in values])
            if tuple(joined.shape) != first.shape:
                raise StateLost(f"--on-failure continue: the shards' rows make a tensor of shape "
                                f"{tuple(joined.shape)}, not {first.shape}; the job ends here and its last "
                                "checkpoint stands")
            return joined
        if isinstance(first, dict):
            return {key: whole([v[key] for v in values]) for key in first}
        if isinstance(first, (list, tuple)):
            return type(first)(whole([v[i] for v in values]) for i in range(len(first)))
        return first

    return whole([part["state"] for part in parts])


def _rows(state: Any) -> Any:
    """``state`` copied (:func:`~polytrain.train.background.copy_state`), each ``DTensor`` as this rank's rows
    (:class:`Rows`) or, replicated, its whole local tensor; tensors detached and on the host."""
    return copy_state(state, _tensor_rows)


def _tensor_rows(value: torch.Tensor) -> Any:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(value, DTensor):
        return value.detach().to("cpu", copy=True)
    sharded = [p for p in value.placements if not isinstance(p, Replicate)]
    local = value.to_local().detach().to("cpu", copy=True)
    if not sharded:
        return local
    if len(sharded) > 1 or not isinstance(sharded[0], Shard) or sharded[0].dim != 0:
        raise ValueError(f"--on-failure continue heals tensors sharded on their first dimension over one axis; "
                         f"this one is placed {value.placements}")
    return Rows(local, tuple(value.shape))
