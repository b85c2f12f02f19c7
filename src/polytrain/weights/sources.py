"""Weights read by name and by region: a rank asks for the rows (or any block) of a tensor it holds and reads only
those bytes, never the whole file.

* :class:`SafetensorsSource`: one or many ``*.safetensors`` files (a Hugging Face model directory with its
  ``model.safetensors.index.json``, or one file), each region read from the file's bytes (``os.preadv``).
* :class:`MappedSource`: tensors of a ``torch.save`` file (a ``state_dict``, a polytrain checkpoint), loaded
  with ``torch.load(mmap=True, weights_only=True)`` on a shared, read-only use of the mapping: the pages of the
  rows read are all that is paged in, and a shared file mapping is not private memory, so it does not count
  against ``--memory-limit``. Every read is copied out of the mapping (nothing can write into the file).
* :class:`PartsSource`: a polytrain checkpoint written in parts (one file per rank of a sharded run,
  :mod:`polytrain.train.sharded`), each part mapped so; a region is put together from the rows of the parts
  that hold them, whatever the world size that wrote them.

:func:`polytrain.weights.opening.open_weights` opens what ``--init-from PATH`` names.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from polytrain.errors import ConfigError
from polytrain.weights.safetensors_file import read_header

Region = "tuple[slice, ...] | None"  # one slice per dimension; None: the whole tensor

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}
INDEX = "model.safetensors.index.json"
_WHOLE = -1  # a part's offset for a tensor it holds whole (polytrain.train.sharded.WHOLE)


class Source:
    """Tensors by name: their whole shapes and dtypes (:meth:`tensors`) and any region of one (:meth:`read`);
    :attr:`bytes_read` counts the bytes of what was read."""

    where: str = ""
    bytes_read: int = 0

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        raise NotImplementedError

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The region of tensor ``name`` (None: all of it), as a new CPU tensor of the file's dtype."""
        raise NotImplementedError

    def close(self) -> None:
        """Let go of open files (a source stays usable: it opens them again)."""


class SafetensorsSource(Source):
    """Tensors of ``*.safetensors`` files, ``files`` mapping each tensor's name to the file holding it. Each
    file's header is read once; a region is read with ``os.preadv`` of the bytes of the rows that hold it (a
    tensor's rows are consecutive in the file), never a mapping of the file: a mapping of the whole file (as
    ``safe_open`` makes it, copy-on-write) counts the file's size against ``--memory-limit`` while it is open."""

    def __init__(self, files: Mapping[str, Path], where: str):
        self.where, self._files = where, dict(files)
        self._entries: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}  # shape, dtype, file offset
        for path in sorted(set(self._files.values())):
            for name, (shape, dtype, offset) in _entries(path, where).items():
                if self._files.get(name) == path:
                    self._entries[name] = (shape, dtype, offset)
        absent = [name for name in self._files if name not in self._entries]
        if absent:
            raise ConfigError(f"{where}: {INDEX} places {', '.join(absent[:3])} in files that do not hold "
                              f"{'it' if len(absent) == 1 else 'them'}; copy the whole model directory")

    @classmethod
    def of_files(cls, paths: Iterable[Path], where: str) -> "SafetensorsSource":
        return cls({name: path for path in paths for name in _entries(path, where)}, where)

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (shape, dtype) for name, (shape, dtype, _) in self._entries.items()}

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        shape, dtype, offset = self._entries[name]
        rows = range(shape[0])[region[0]] if region and shape else None
        low, high = (rows.start, max(rows.start, rows.stop)) if rows is not None and rows.step == 1 else \
            (0, shape[0] if shape else 1)
        per_row = torch.Size(shape[1:]).numel() * dtype.itemsize
        data = bytearray(per_row * (high - low))
        if data:
            with open(self._files[name], "rb", buffering=0) as f:
                got = os.preadv(f.fileno(), [data], offset + low * per_row)
            if got != len(data):
                raise ConfigError(f"{self.where}: {self._files[name].name} is cut short in {name}; copy the whole "
                                  "model directory again")
        block = (torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)).reshape(
            (high - low, *shape[1:]) if shape else ())
        if region is not None and shape:  # the rows read: the rest of the region cut out of them
            first = slice(None) if rows.step == 1 else region[0]
            block = block[(first, *region[1:])].clone(memory_format=torch.contiguous_format)
        return self._count(block)


def _entries(path: Path, where: str) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """The tensors of one safetensors file: shape, dtype and where its bytes begin, by name."""
    try:
        header, start = read_header(path)
        return {name: (tuple(e["shape"]), SAFETENSORS_DTYPES[e["dtype"]], start + e["data_offsets"][0])
                for name, e in header.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: {path.name} is not a safetensors file polytrain can read ({exc!r}); "
                          "give the model's *.safetensors as save_pretrained writes them") from None


class MappedSource(Source):
    """Tensors of a mapping loaded by :func:`load_mapped`, read by copying the region out of the mapping."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str):
        self.where = where
        self._tensors = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (tuple(t.shape), t.dtype) for name, t in self._tensors.items()}

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        tensor = self._tensors[name]
        return self._count((tensor if region is None else tensor[region]).clone(memory_format=torch.contiguous_format))


class PartsSource(Source):
    """Tensors written in parts: ``pieces[name]`` lists ``[offset, rows]`` (rows along the first dimension from
    ``offset``; ``[-1, tensor]``: a part that holds it whole), each from a mapped part file."""

    def __init__(self, pieces: Mapping[str, list[list[Any]]], shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                 where: str):
        self.where, self._pieces, self._shapes = where, dict(pieces), dict(shapes)

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        pieces = self._pieces[name]
        whole = [p[1] for p in pieces if p[0] == _WHOLE]
        if whole:
            return self._count((whole[0] if region is None else whole[0][region]).clone(
                memory_format=torch.contiguous_format))
        shape = self._shape_of(name)
        rows = region[0] if region else slice(0, shape[0])
        start, stop = rows.start or 0, shape[0] if rows.stop is None else rows.stop
        rest = tuple(region[1:]) if region else ()
        taken = []
        for offset, held in sorted(pieces, key=lambda p: p[0]):
            low, high = max(start, offset), min(stop, offset + held.shape[0])
            if low < high:
                taken.append(held[low - offset:high - offset][(slice(None), *rest)])
        out = torch.cat(taken) if taken else torch.empty((0, *shape[1:]), dtype=pieces[0][1].dtype)
        if out.shape[0] != stop - start:
            raise ConfigError(f"{self.where}: its parts leave rows of {name} out (rows {start}..{stop - 1} asked, "
                              f"{out.shape[0]} found)")
        return self._count(out)  # (torch.cat made a new tensor: nothing of the mapping)


    def _shape_of(self, name: str) -> tuple[int, ...]:
        if name in self._shapes:
            return self._shapes[name][0]
        pieces = self._pieces[name]
        whole = [held for offset, held in pieces if offset == _WHOLE]
        if whole:
            return tuple(whole[0].shape)
        rows = max(offset + held.shape[0] for offset, held in pieces)
        return (rows, *pieces[0][1].shape[1:])

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {name: (self._shape_of(name), self._shapes[name][1] if name in self._shapes else pieces[0][1].dtype)
                for name, pieces in self._pieces.items()}


def load_mapped(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` with every tensor mapped from the file (a shared mapping: pages
    are read when touched, and are not this process's private memory); a file torch cannot map (the legacy
    format) is loaded whole."""
    try:
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except RuntimeError as exc:
        if "mmap" not in str(exc) and "zip" not in str(exc):
            raise
        return torch.load(path, weights_only=True, map_location="cpu")
