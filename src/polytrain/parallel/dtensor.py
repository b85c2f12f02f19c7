"""One home for what every axis does with DTensors: a rank's local shard, the whole tensor, a whole value cut
as a live tensor is, the optimizer built again after the parameters changed, the squared norm of gradients
placed over several meshes, and an average over one axis of the mesh.

A DTensor (``torch.distributed.tensor``) is how FSDP2 (``fully_shard``) and tensor parallel
(``parallelize_module``) hold a parameter: its shape is the whole tensor's, ``to_local()`` is this rank's
piece and ``full_tensor()`` gathers the whole (a collective over its mesh). Plain tensors pass through every
function here unchanged, so the same code serves a model whatever the axes did to it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor, distribute_tensor


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor (its local shard), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full(value: Any) -> Any:
    """A DTensor gathered whole (a collective over its mesh), else ``value`` itself."""
    if not isinstance(value, DTensor):
        return value
    nested = _sharded_over_parts(value)
    return value.full_tensor() if nested is None else _full_over_parts(value, *nested)


def like(value: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A whole tensor ``value`` as ``live`` holds it: a DTensor's piece of it (cut here, no exchange: every rank
    has the whole value), else ``value`` itself."""
    if not isinstance(live, DTensor) or value.shape != live.shape:
        return value
    nested = _sharded_over_parts(live)
    if nested is not None:
        return _like_over_parts(value.to(live.device), live, *nested)
    return distribute_tensor(value.to(live.device), live.device_mesh, live.placements, src_data_rank=None)


# -- FSDP over a tp split of several parts ----------------------------------------------------------------
# A fused projection's output of several parts (q, k, v) is split over tp as ``_StridedShard(0, parts)``; FSDP
# then shards each rank's piece along the same dim, as torch.chunk over its mesh dim, and labels it a second
# _StridedShard, which DTensor's gather does not put back in order. These two gather and cut it as FSDP holds it.

def _sharded_over_parts(tensor: DTensor) -> tuple[int, int] | None:
    """(the mesh dim FSDP shards over, the tensor dim) of a DTensor whose last mesh dim (tp) holds it as
    ``_StridedShard`` and another mesh dim shards the same tensor dim; None for any other placement."""
    from torch.distributed.tensor.placement_types import _StridedShard

    places = tensor.placements
    if tensor.device_mesh.ndim < 2 or not isinstance(places[-1], _StridedShard):
        return None
    for mesh_dim, place in enumerate(places[:-1]):
        if (place.is_shard() or isinstance(place, _StridedShard)) and place.dim == places[-1].dim:
            return mesh_dim, place.dim
    return None


def _tp_piece_shape(tensor: DTensor) -> tuple[Any, list[int]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = tensor.device_mesh
    tp_mesh = mesh[mesh.mesh_dim_names[-1]]
    shape, _ = compute_local_shape_and_global_offset(tensor.shape, tp_mesh, [tensor.placements[-1]])
    return tp_mesh, list(shape)


def _full_over_parts(tensor: DTensor, mesh_dim: int, dim: int) -> torch.Tensor:
    mesh = tensor.device_mesh
    size, group = mesh.size(mesh_dim), mesh.get_group(mesh_dim)
    tp_mesh, shape = _tp_piece_shape(tensor)
    rows, chunk = shape[dim], -(-shape[dim] // size)
    mine = tensor.to_local()
    padded = torch.zeros([chunk if d == dim else s for d, s in enumerate(shape)], dtype=mine.dtype,
                         device=mine.device)
    padded.narrow(dim, 0, mine.shape[dim]).copy_(mine)
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded, group=group)
    piece = torch.cat(pieces, dim).narrow(dim, 0, rows)  # torch.chunk's pieces: only the last ones short
    return DTensor.from_local(piece, tp_mesh, [tensor.placements[-1]], run_check=False, shape=tensor.shape,
                              stride=tensor.stride()).full_tensor()


def _like_over_parts(value: torch.Tensor, live: DTensor, mesh_dim: int, dim: int) -> torch.Tensor:
    mesh = live.device_mesh
    tp_mesh, _ = _tp_piece_shape(live)
    piece = distribute_tensor(value, tp_mesh, [live.placements[-1]], src_data_rank=None).to_local()
    chunks = torch.chunk(piece, mesh.size(mesh_dim), dim)
    index = mesh.get_local_rank(mesh_dim)
    mine = chunks[index] if index < len(chunks) else piece.narrow(dim, 0, 0)
    return DTensor.from_local(mine.contiguous(), mesh, live.placements, run_check=False, shape=live.shape,
                              stride=live.stride())


def shard_of(piece: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """A rank's ``piece`` (a local tensor shaped as ``live``'s local one: an optimizer's state of it, say) as a
    DTensor placed as ``live`` is, for :func:`full`; ``piece`` itself where ``live`` is a plain tensor."""
    if not isinstance(live, DTensor):
        return piece
    return DTensor.from_local(piece, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                              stride=live.stride())


def is_split(tensor: torch.Tensor) -> bool:
    """Whether a rank holds only a piece of ``tensor`` (a DTensor sharded over some axis of its mesh)."""
    return isinstance(tensor, DTensor) and any(not p.is_replicate() for p in tensor.placements)


def rebuild_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer,
                      make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The optimizer built again over ``model``'s parameters (in ``single``'s order), after an axis replaced
    their Parameter objects (``fully_shard``, a tp split), holding the state ``optimizer`` held (a resumed
    checkpoint's), each tensor of it cut as its parameter now is."""
    held = optimizer.state_dict()
    held = {**held, "state": {i: {k: full(v) for k, v in per.items()} for i, per in held["state"].items()}}
    rebuilt = make_optimizer(model.parameters())
    params = [p for group in rebuilt.param_groups for p in group["params"]]
    rebuilt.load_state_dict({**held, "state": {
        i: {key: like(value, params[int(i)]) if torch.is_tensor(value) and key != "step" else value
            for key, value in per.items()} for i, per in held["state"].items()}})
    return rebuilt


def squared_norm(grads: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared norm of the whole gradient from each rank's pieces: a DTensor's local squared norm summed
    over the axes of its mesh it is sharded over (counted once where it is replicated), a plain tensor's as
    it is. Collective over those axes' groups: every rank calls it with its gradients in the same order."""
    buckets: dict[tuple[Any, ...], list[torch.Tensor]] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh
            groups = tuple(mesh.get_group(dim) for dim, p in enumerate(grad.placements) if not p.is_replicate())
            buckets.setdefault(groups, []).append(grad.to_local())
        else:
            buckets.setdefault((), []).append(grad)
    total = torch.zeros((), device=device)
    for groups, pieces in sorted(buckets.items(), key=lambda item: len(item[0])):
        part = torch.stack([torch.linalg.vector_norm(p.float(), 2) for p in pieces]).square().sum().to(device)
        for group in groups:
            dist.all_reduce(part, group=group)
        total = total + part
    return total


def clip(params: Iterable[nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """``clip_grad_norm_`` of the whole model over parameters placed on any meshes (FSDP's, tp's, both):
    :func:`squared_norm`, then every local gradient scaled alike. Returns the whole gradient's norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = squared_norm(grads, device).sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for grad in grads:
        local(grad).mul_(coef.to(local(grad).dtype))
    return norm


def average(tensors: list[torch.Tensor], group: Any, size: int) -> int:
    """Each tensor (its local piece) replaced by its average over the ``size`` ranks of ``group``: one
    all-reduce per dtype. Returns the bytes all-reduced."""
    if size < 2:
        return 0
    moved = 0
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(local(tensor))
    for pieces in by_dtype.values():
        flat = _flatten_dense_tensors([p.detach() for p in pieces])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        moved += flat.numel() * flat.element_size()
        for piece, value in zip(pieces, _unflatten_dense_tensors(flat, pieces)):
            piece.data.copy_(value)
    return moved


def whole_state(model: nn.Module, optimizer: torch.optim.Optimizer, with_optimizer: bool = True,
                state: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The whole model's state dict (of ``state``, the model's own by default) and (``with_optimizer``) its
    optimizer's, every DTensor gathered whole (:func:`full`: a collective over its mesh: every rank calls it),
    indexed as ``single``'s optimizer is."""
    state = {key: full(value) for key, value in (model.state_dict() if state is None else state).items()}
    held = optimizer.state_dict() if with_optimizer else None
    if held is not None:
        held = {**held, "state": {i: {k: full(v) for k, v in per.items()} for i, per in held["state"].items()}}
    return state, held


def load_whole(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load ``single``'s whole model and optimizer state (every rank has all of it), each tensor cut as the
    live one is held (:func:`like`: no exchange)."""
    live = model.state_dict()
    model.load_state_dict({k: like(v, live[k]) if k in live else v for k, v in state["model"].items()})
    params = [p for group in optimizer.param_groups for p in group["params"]]
    held = state["optimizer"]
    optimizer.load_state_dict({**held, "state": {
        i: {k: like(v, params[int(i)]) if torch.is_tensor(v) and k != "step" else v for k, v in per.items()}
        for i, per in held["state"].items()}})
