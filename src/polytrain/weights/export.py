"""The model as it came: a Hugging Face directory (``config.json``, ``model-0000K-of-0000N.safetensors`` and
``model.safetensors.index.json``, as ``save_pretrained`` writes them) or one ``.safetensors`` file, written one
tensor at a time (:mod:`.safetensors_file`), never the whole model in one process.

* :func:`export_source`: from a checkpoint (``polytrain checkpoint export``), in one process: each tensor read
  from the checkpoint (one file, or the parts of a sharded run) and written, then the next.
* :func:`polytrain.weights.save.save_model`: at the end of training (``--save-model DIR``), collective over the
  trainer ranks. Each rank says which tensors it holds (whole, or a shard of a ``DTensor``), the tensors are
  planned into files that one rank can write whole (a pipeline stage's on its rank), each file going to the
  lowest rank that can write it (rank 0 wherever it holds or gathers every tensor, so runs over machines without a shared file system
  leave one complete directory); then, tensor by tensor in the model's order, a sharded tensor is gathered
  (``full_tensor``, by the ranks sharing it) and the rank writing its file writes it. Rank 0 writes the index
  and the config last. A strategy whose ranks' tensors are not the model (replicas averaged at saving,
  parameter servers: no ``held_state`` capability) hands its ``state_dict`` to rank 0, which writes it the same way.

Files are written under temporary names and renamed into place once every file is complete; the index comes
last, and shards an earlier save left that the new index does not name are removed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from polytrain.train.files import atomic_write_text
from polytrain.weights.safetensors_file import DEFAULT_SHARD_BYTES, Entry, SafetensorsFile, plan_shards, shard_name
from polytrain.weights.sources import INDEX

SHARD = "model-*-of-*.safetensors"


def is_directory_target(path: str | os.PathLike) -> bool:
    """Whether a ``--save-model`` / export path names a Hugging Face directory: an existing directory, a path
    ending in ``/``, or one without a suffix."""
    text = str(path)
    return os.path.isdir(text) or text.endswith(os.sep) or not Path(text).suffix


def check_save_model(path: str | None, shard_size: str) -> None:
    """``--save-model`` and ``--save-shard-size`` before anything starts: one ConfigError line if the size is not
    one, or a Hugging Face directory is asked for where a file is (or a file where a directory is)."""
    from polytrain.devices.memory_limit import parse_size
    from polytrain.errors import ConfigError

    try:
        parse_size(shard_size)
    except ValueError as exc:
        raise ConfigError(f"--save-shard-size: {exc}") from None
    if not path:
        return
    if is_directory_target(path) and os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"--save-model {path}: is a file; give a directory to write a Hugging Face model into "
                          "(a path without a suffix, or ending in /), or FILE.pt / FILE.safetensors for one file")


def written_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for floating tensors (bf16-true's bfloat16 widened, exactly, as checkpoints hold them)."""
    return torch.float32 if dtype.is_floating_point else dtype


def hf_config_text(model: Any) -> str | None:
    """The ``config.json`` of a transformers model (None: the model is not one)."""
    config = getattr(model, "config", None)
    to_json = getattr(config, "to_json_string", None)
    return to_json() if callable(to_json) else None


def finish_directory(directory: Path, records: list[dict[str, Any]], config_text: str | None) -> None:
    """The index (and ``config.json``) of a directory whose shards are in place; shards of an earlier save that
    the index does not name are removed."""
    weight_map = {name: record["file"] for record in records for name in record["tensors"]}
    total = sum(int(record["bytes"]) for record in records)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if config_text is not None:
        atomic_write_text(directory / "config.json", config_text if config_text.endswith("\n") else config_text + "\n")
    atomic_write_text(directory / INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
    named = {record["file"] for record in records}
    for old in directory.glob(SHARD):
        if old.name not in named:
            old.unlink(missing_ok=True)


def shard_paths(directory: Path, n: int) -> list[Path]:
    """The paths of a Hugging Face directory's ``n`` shards."""
    return [directory / shard_name(k + 1, n) for k in range(n)]


def write_tensors(target: Path, entries: list[Entry], read: Callable[[str], torch.Tensor],
                  config_text: str | None = None, max_bytes: int = DEFAULT_SHARD_BYTES,
                  metadata: dict[str, str] | None = None, directory: bool | None = None) -> list[dict[str, Any]]:
    """``entries`` written to ``target`` (``directory``, by default :func:`is_directory_target`: shards and
    index; else one ``.safetensors`` file), each tensor got from ``read(name)`` when its turn comes, in one
    process; the files' records."""
    directory = is_directory_target(target) if directory is None else directory
    single = None if directory else target
    planned = [files for files, _ in plan_shards(entries, max_bytes if single is None else 2**63)]
    if single is None:
        target.mkdir(parents=True, exist_ok=True)
    paths = [single] if single is not None else shard_paths(target, len(planned))
    records = []
    for entries_of, path in zip(planned, paths):
        out = SafetensorsFile(path, entries_of, {"format": "pt", **(metadata or {})})
        try:
            for entry in entries_of:
                out.write(entry.name, read(entry.name))
        except BaseException:
            out.abort()
            raise
        records.append(out.finish())
    if single is None:
        finish_directory(target, records, config_text)
    return records


def export_source(target: Path, source: Any, names: Iterable[str], config_text: str | None = None,
                  max_bytes: int = DEFAULT_SHARD_BYTES, metadata: dict[str, str] | None = None,
                  directory: bool | None = None) -> list[dict[str, Any]]:
    """A checkpoint's model (a :class:`~polytrain.weights.sources.Source`) written to ``target``, one tensor read
    and written at a time."""
    shapes = source.tensors()
    entries = [Entry(name, tuple(shapes[name][0]), written_dtype(shapes[name][1])) for name in names]
    return write_tensors(target, entries, source.read, config_text, max_bytes, metadata, directory)
