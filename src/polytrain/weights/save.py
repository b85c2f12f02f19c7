"""``--save-model DIR`` (or ``FILE.safetensors``) at the end of training: collective over the trainer ranks,
each file written by the lowest rank that holds (or gathers) its tensors, one tensor at a time (see :mod:`.export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from polytrain.errors import CheckpointError
from polytrain.weights.export import (finish_directory, hf_config_text, is_directory_target, shard_paths,
                                      write_tensors, written_dtype)
from polytrain.weights.fill import local_of
from polytrain.weights.safetensors_file import DEFAULT_SHARD_BYTES, Entry, SafetensorsFile, plan_shards

_SHARDED, _WHOLE, _NONE = "d", "w", "-"


def _held(module: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, str]]:
    """Each tensor of the model's state_dict as this rank holds it: (name, whole shape, dtype, kind)."""
    rows = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        if not isinstance(tensor, torch.Tensor):
            continue
        local = local_of(tensor)
        if hasattr(tensor, "device_mesh"):
            kind = _SHARDED
        elif local.is_meta or (local.numel() == 0 and tensor.dim() > 0):
            kind = _NONE
        else:
            kind = _WHOLE
        rows.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), kind))
    return rows


def _entry(name: str, shape: tuple[int, ...], dtype: str) -> Entry:
    return Entry(name, shape, written_dtype(getattr(torch, dtype)))


def save_model(strategy: Any, target: str | Path, max_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write the trained model to ``target`` (a directory: Hugging Face's shards, index and config; else one
    safetensors file). Collective over ``strategy.trainers``."""
    target = Path(target)
    trainers = strategy.trainers
    config_text = hf_config_text(strategy.module)
    if strategy.held_state is not None:  # the ranks' tensors are the model: written from them, one at a time
        tables = trainers.all_gather_object(_held(strategy.module))
        if _save_held(strategy, tables, target, config_text, max_bytes):
            return
    state = strategy.state_dict(optimizer=False)  # the strategy's whole model, on rank 0 (collective)
    if trainers.is_main:
        model = state["model"]
        entries = [_entry(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in model.items()
                   if isinstance(t, torch.Tensor)]
        _guarded(lambda: write_tensors(target, entries, model.__getitem__, config_text, max_bytes), target)


def _save_held(strategy: Any, tables: list[list[tuple]], target: Path, config_text: str | None,
               max_bytes: int) -> bool:
    """Each file is written by the lowest rank that can write it whole, sharded tensors gathered one at a time;
    False (nothing done) where some tensor has no rank holding it, or one file has no rank that could write it whole."""
    trainers, me = strategy.trainers, strategy.trainers.rank
    mine = tables[me]
    names = [row[0] for row in mine]
    if any([row[0] for row in table] != names for table in tables):
        return False
    able = [frozenset(r for r, table in enumerate(tables) if table[i][3] != _NONE) for i in range(len(names))]
    if not all(able):
        return False
    entries = []
    for i, name in enumerate(names):
        holder = next(r for r in sorted(able[i]))
        entries.append(_entry(name, tables[holder][i][1], tables[holder][i][2]))
    directory = is_directory_target(target)
    planned = plan_shards(entries, max_bytes if directory else 2**63, able)
    if not directory and len(planned) > 1:
        return False
    # the lowest rank able writes each file: rank 0 all of them where it holds (or gathers) every tensor, so a
    # run over machines that share no file system still leaves one complete directory on rank 0's
    writer = [min(ranks) for _, ranks in planned]
    paths = shard_paths(target, len(planned)) if directory else [target]
    file_of = {entry.name: k for k, (entries_of, _) in enumerate(planned) for entry in entries_of}
    opened: dict[int, SafetensorsFile] = {}
    problem = None
    try:
        if directory:
            target.mkdir(parents=True, exist_ok=True)
        for k, (entries_of, _) in enumerate(planned):
            if writer[k] == me:
                opened[k] = SafetensorsFile(paths[k], entries_of)
    except OSError as exc:
        problem = f"{exc.strerror or exc}"
    state = strategy.module.state_dict(keep_vars=True)
    with torch.no_grad():
        for i, name in enumerate(names):
            kind = mine[i][3]
            if kind == _NONE:
                continue
            tensor = state[name]
            value = tensor.full_tensor() if kind == _SHARDED else tensor  # (collective: the ranks sharing it)
            k = file_of[name]
            if k in opened and problem is None:
                try:
                    opened[k].write(name, value)
                except OSError as exc:
                    problem = f"{exc.strerror or exc}"
    records: list[dict[str, Any]] = []
    if problem is None:
        try:
            records = [opened[k].finish(place=False) for k in sorted(opened)]
        except OSError as exc:
            problem = f"{exc.strerror or exc}"
    problems = [p for p in trainers.all_gather_object(problem) if p is not None]
    if problems:  # nothing placed anywhere: every rank removes its temporary files
        for out in opened.values():
            out.abort()
        raise CheckpointError(f"--save-model {target}: cannot write the model there ({problems[0]}); free space or "
                              "give another path")
    for k in sorted(opened):
        opened[k].place()
    everyone = [r for rs in trainers.all_gather_object(records) for r in rs]  # (every file in place after it)
    if directory and trainers.is_main:
        _guarded(lambda: finish_directory(target, sorted(everyone, key=lambda r: r["file"]), config_text), target)
    trainers.barrier()
    return True


def _guarded(write: Any, target: Path) -> None:
    try:
        write()
    except OSError as exc:
        raise CheckpointError(f"--save-model {target}: cannot write the model there ({exc.strerror or exc}); free "
                              "space or give another path") from None

