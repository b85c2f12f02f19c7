"""Filling a model's tensors from a :class:`~polytrain.weights.sources.Source`, each rank reading only what it
holds, and checking before anything is filled that the weights fit the model.

What a rank holds of a tensor (:func:`region_of`): a ``DTensor`` (an ``fsdp`` or ``tp`` shard) holds the block
its placements give (``compute_local_shape_and_global_offset``: rows under FSDP2, rows or columns under tp);
a plain tensor holds the whole; a tensor on the meta device, or emptied (a pipeline rank's other stages),
holds nothing. Filling reads each held block from the source and copies it into the tensor's local part,
converting the dtype (a bfloat16 file into float32 parameters); the Parameter objects stay the model's.

Names are the model's ``state_dict`` names: parameters and persistent buffers. Tensors tied together (one
tensor under two names, GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) are filled once, from
whichever of their names the source has; a non-persistent buffer (rotary ``inv_freq``) is never read: the
model computes it.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.weights.sources import Source


def region_of(tensor: torch.Tensor) -> tuple[slice, ...] | None:
    """The block of the whole tensor this rank holds of ``tensor`` (None: the whole, or a placement that is not
    one block: a ``_StridedShard``, tp's share of each of a fused projection's parts)."""
    if not hasattr(tensor, "device_mesh") or not _blocks(tensor):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def read_held(tensor: torch.Tensor, source: Source, key: str) -> torch.Tensor:
    """What this rank holds of ``tensor``, read from ``source``'s ``key``: only its block where the placement is
    one (rows, columns), else the whole, cut as the placement cuts it."""
    if hasattr(tensor, "device_mesh") and not _blocks(tensor):
        from torch.distributed.tensor import distribute_tensor

        whole = source.read(key)
        return distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
    return source.read(key, region_of(tensor))


def _blocks(tensor: torch.Tensor) -> bool:
    from torch.distributed.tensor import Replicate, Shard

    return all(type(p) in (Shard, Replicate) for p in tensor.placements)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor, or the tensor itself, without importing ``torch.distributed.tensor`` (for
    what runs before any axis did: :func:`polytrain.parallel.dtensor.local` where DTensors are at hand)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def held(tensor: torch.Tensor) -> bool:
    """Whether this rank holds any of ``tensor`` (not on the meta device, not emptied, not an empty shard)."""
    local = local_of(tensor)
    return not local.is_meta and local.numel() > 0


def groups(module: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """The module's parameters and persistent buffers, each once with every name it has (tied tensors: several),
    in ``state_dict`` order."""
    found: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            found.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(found.values())


def misfit(module: nn.Module, source: Source, prefix: str = "") -> str | None:
    """Why ``source`` does not fit ``module`` (its tensors named ``prefix + name``): the missing, unexpected and
    wrongly shaped tensors in one sentence; None: it fits."""
    have = source.tensors()
    missing, wrong, wanted = [], [], set()
    for names, tensor in groups(module):
        keys = [prefix + n for n in names]
        wanted.update(keys)
        present = [k for k in keys if k in have]
        if not present:
            missing.append(keys[0])
        elif tuple(have[present[0]][0]) != tuple(tensor.shape):
            wrong.append(f"{present[0]} is {_shape(have[present[0]][0])} there, {_shape(tensor.shape)} in the model")
    unexpected = [k for k in have if k not in wanted and k.startswith(prefix)]
    if not (missing or wrong or unexpected):
        return None
    parts = ([f"shapes differ: {_listed(wrong)}"] if wrong else []) + \
        ([f"missing {len(missing)}: {_listed(missing)}"] if missing else []) + \
        ([f"unexpected {len(unexpected)}: {_listed(unexpected)}"] if unexpected else [])
    return "; ".join(parts)


def check_fits(module: nn.Module, source: Source) -> None:
    """One ConfigError line when ``source`` does not hold exactly ``module``'s tensors with their shapes."""
    problem = misfit(module, source)
    if problem:
        raise ConfigError(f"{source.where} does not fit the model ({problem}); give the weights of this model "
                          "(the same architecture and sizes)")


@torch.no_grad()
def fill(module: nn.Module, source: Source, prefix: str = "") -> int:
    """Copy into each tensor of ``module`` this rank holds its block from ``source`` (names ``prefix + name``);
    the number of tensors filled. The caller has checked the fit (:func:`check_fits`)."""
    have = source.tensors()
    filled = 0
    for names, tensor in groups(module):
        key = next((prefix + n for n in names if prefix + n in have), None)
        if key is None or not held(tensor):
            continue
        local = local_of(tensor)
        local.copy_(read_held(tensor, source, key))
        filled += 1
    return filled


def named_held(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter and persistent buffer this rank holds some of, by its first name."""
    for names, tensor in groups(module):
        if not local_of(tensor).is_meta:
            yield names[0], tensor


def _shape(shape: tuple[int, ...] | torch.Size) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:4])
    return shown + (f" and {len(items) - 4} more" if len(items) > 4 else "")
