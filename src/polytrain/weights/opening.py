"""What ``--init-from PATH`` names, opened as a :class:`~polytrain.weights.sources.Source`: a Hugging Face model
directory, a polytrain checkpoint directory, a ``.safetensors`` file or a ``torch.save`` file. Each is one
``ConfigError`` line when it cannot be used (see docs/errors.md).

Apart from :mod:`polytrain.weights.sources` because a checkpoint directory is opened as ``--resume`` opens it
(:mod:`polytrain.train.lazy`), which itself reads through those sources.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

import torch

from polytrain.errors import ConfigError
from polytrain.weights.sources import INDEX, MappedSource, SafetensorsSource, Source, load_mapped


def state_dict_of(loaded: Any) -> Mapping[str, torch.Tensor] | None:
    """The tensors by name in what a ``torch.save`` file held: a state_dict, a polytrain checkpoint's
    ``model``, or the ``model``/``state_dict`` entry of a training script's checkpoint (None: none of these)."""
    if isinstance(loaded, Mapping):
        for key in ("model", "state_dict"):
            inner = loaded.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                return inner
        if loaded and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()):
            return loaded
    return None


_PART = re.compile(r"^step-\d{8,}\.part-\d+-of-\d+\.pt$")
ACCEPTED = ("give a Hugging Face model directory (config.json and model*.safetensors), a polytrain "
            "--checkpoint-dir, or a state_dict file (.pt, .safetensors)")


def open_weights(path: str | Path, where: str | None = None) -> Source:
    """The weights ``path`` names: a Hugging Face model directory, a polytrain checkpoint directory (its newest
    good checkpoint, verified as ``--resume`` verifies it), a ``.safetensors`` file or a ``torch.save`` file.
    ``where``: how messages name it (``--init-from PATH``)."""
    where = where or f"--init-from {path}"
    found = Path(path).expanduser()
    if not found.exists():
        raise ConfigError(f"{where}: no such file or directory; {ACCEPTED}")
    if found.is_dir():
        if (found / "latest").is_file() or any(found.glob("step-*.pt")):
            return checkpoint_weights(found, where)
        return hf_weights(found, where)
    if found.suffix == ".safetensors":
        return SafetensorsSource.of_files([found], where)
    try:
        loaded = load_mapped(found)
    except Exception as exc:  # noqa: BLE001 - not a torch file, or one that needs pickled code: say what torch said
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"{where}: cannot be read as a state_dict ({first}); {ACCEPTED}") from None
    tensors = state_dict_of(loaded)
    if tensors is None:
        raise ConfigError(f"{where}: holds no state_dict (tensors by name); {ACCEPTED}")
    return MappedSource(tensors, where)


def hf_weights(directory: Path, where: str) -> Source:
    """A Hugging Face model directory's weights: the files its ``model.safetensors.index.json`` names, or its
    ``*.safetensors`` files."""
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{where}: {INDEX} cannot be read ({exc}); write it again or remove it") from None
        missing = sorted({f for f in weight_map.values() if not (directory / f).is_file()})
        if missing:
            raise ConfigError(f"{where}: {INDEX} names {', '.join(missing[:3])}, which "
                              f"{'is' if len(missing) == 1 else 'are'} not in the directory; copy the whole "
                              "model directory")
        return SafetensorsSource({name: directory / f for name, f in weight_map.items()}, where)
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        found = sorted(p.name for p in directory.iterdir())[:5]
        bins = " (pytorch_model.bin: save the model again with save_pretrained(DIR), which writes safetensors)" \
            if (directory / "pytorch_model.bin").exists() else ""
        raise ConfigError(f"{where}: no *.safetensors file in this directory{bins} (it holds "
                          f"{', '.join(found) or 'nothing'}); {ACCEPTED}")
    return SafetensorsSource.of_files(files, where)


def checkpoint_weights(directory: Path, where: str) -> Source:
    """The model of a polytrain checkpoint directory's newest good checkpoint, each rank reading its regions."""
    from polytrain.train.lazy import open_checkpoint

    return open_checkpoint(directory, where=where).model
