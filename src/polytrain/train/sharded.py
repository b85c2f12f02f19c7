"""Checkpoints in parts: each rank of a sharded run (``fsdp``) writes the shard it holds, nothing is gathered.

``step-00000100.pt`` is then a small main file (step, data position, RNG states, config, the optimizer's
hyper-parameters and the model's signature: every tensor's name, whole shape and dtype) and each rank R of W
writes ``step-00000100.part-R-of-W.pt``: for every tensor, its piece (a run of rows along the first dimension,
with the row it starts at) or, for a tensor every rank holds whole (a buffer, Adam's step count), rank 0's copy.
The manifest ``step-00000100.json`` lists each part with its size and SHA-256, and the checkpoint counts as
written only once the main file, its manifest and every part are in place (see
:meth:`~polytrain.train.checkpoint.Checkpointer.save_parts`).

Reading puts the pieces back together (:func:`assemble`): the result is the checkpoint ``single`` writes, so a
sharded checkpoint resumes into any strategy and world size, and ``polytrain checkpoint export`` writes single's
layout. Parts are plain ``torch.save`` files of tensors, lists and numbers, loaded with ``weights_only=True``:
like every polytrain checkpoint they need no pickled code, so they are as safe to read as a safetensors file.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

PART_FORMAT = "polytrain.checkpoint-part/1"
PART = re.compile(r"^step-(\d{8,})\.part-(\d+)-of-(\d+)\.pt$")
WHOLE = -1  # the offset of a tensor a part holds whole


def part_path(path: Path, rank: int, parts: int) -> Path:
    """Rank ``rank``'s part of the checkpoint ``path`` (``step-N.pt``) of ``parts``."""
    return path.with_name(f"{path.stem}.part-{rank}-of-{parts}.pt")


def parts_of(directory: Path, step: int) -> list[Path]:
    """The part files of step ``step`` present in ``directory``."""
    return sorted(p for p in directory.glob(f"step-{step:08d}.part-*-of-*.pt") if PART.match(p.name))


def piece(tensor: torch.Tensor, rank: int, main: bool) -> list[Any] | None:
    """``[offset, local rows]`` of a tensor sharded along its first dimension over a 1-D mesh (a DTensor, as
    FSDP2 holds parameters and their optimizer state), ``[WHOLE, tensor]`` of a plain one on the main rank, and
    None for a plain one elsewhere (rank 0's copy is the one kept)."""
    if hasattr(tensor, "to_local"):
        placements = tensor.placements
        if len(placements) != 1 or not placements[0].is_shard(0):
            raise ValueError(f"a tensor placed {placements} cannot be written in parts (rows over one mesh "
                             "dimension only)")
        local = tensor.to_local().detach().cpu()
        rows = math.ceil(tensor.shape[0] / tensor.device_mesh.size()) if tensor.dim() else 0
        return [rank * rows, local]  # torch.chunk's cut, as FSDP2 shards
    return [WHOLE, tensor.detach().cpu()] if main else None


def model_part(state: Mapping[str, Any], rank: int, main: bool) -> dict[str, list[Any]]:
    """This rank's pieces of a model state dict whose parameters are DTensors."""
    pieces = {name: piece(value, rank, main) for name, value in state.items() if torch.is_tensor(value)}
    return {name: p for name, p in pieces.items() if p is not None}


def optimizer_part(state: Mapping[int, Mapping[str, Any]], rank: int, main: bool) -> dict[int, dict[str, Any]]:
    """This rank's pieces of a torch optimizer's per-parameter state (by index): tensors as :func:`piece`,
    other values (a step count kept as a number) on the main rank only."""
    part: dict[int, dict[str, Any]] = {}
    for index, values in state.items():
        mine: dict[str, Any] = {}
        for key, value in values.items():
            p = piece(value, rank, main) if torch.is_tensor(value) else ([WHOLE, value] if main else None)
            if p is not None:
                mine[key] = p
        part[int(index)] = mine
    return part


def assemble(main: dict[str, Any], parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The whole checkpoint (single's layout) from its main file and its parts' contents."""
    parts = list(parts)
    info = main["sharded"]
    model = {name: _join([p["model"].get(name) for p in parts], shape, name)
             for name, shape, _ in info["model"]}
    indices = sorted({int(i) for p in parts for i in p["optimizer"]})
    state = {}
    for index in indices:
        keys = {k for p in parts for k in p["optimizer"].get(index, {})}
        state[index] = {key: _join([p["optimizer"].get(index, {}).get(key) for p in parts], None,
                                   f"optimizer state {key} of parameter {index}") for key in sorted(keys)}
    whole = {k: v for k, v in main.items() if k != "sharded"}
    return {**whole, "model": model, "optimizer": {"state": state, "param_groups": info["param_groups"]},
            "written_in_parts": len(parts)}


def _join(pieces: list[list[Any] | None], shape: list[int] | None, what: str) -> Any:
    """One tensor from its pieces ([offset, rows] per part holding some; a whole one's [WHOLE, value])."""
    found = [p for p in pieces if p is not None]
    whole = [p[1] for p in found if p[0] == WHOLE]
    if whole:
        return whole[0]
    if not found:
        raise ValueError(f"no part holds {what}")
    ordered = sorted(found, key=lambda p: p[0])
    expected = 0
    for offset, rows in ordered:
        if rows.shape[0] and offset != expected:
            raise ValueError(f"the parts of {what} leave rows {expected}..{offset - 1} out")
        expected += rows.shape[0]
    joined = torch.cat([rows for _, rows in ordered if rows.shape[0]] or [ordered[0][1]])
    if shape is not None and list(joined.shape) != list(shape):
        raise ValueError(f"the parts of {what} make {list(joined.shape)}, the checkpoint says {list(shape)}")
    return joined
