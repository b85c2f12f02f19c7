"""Weights read by name and by region: a rank asks for the rows (or any block) of a tensor it holds and reads only
those bytes, never the whole file.

* :class:`SafetensorsSource`: one or many ``*.safetensors`` files (a Hugging Face model directory with its
  ``model.safetensors.index.json``, or one file), read with ``safe_open(...).get_slice`` (a read-only mapping).
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
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from polytrain.errors import ConfigError

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
    """Tensors of ``*.safetensors`` files, ``files`` mapping each tensor's name to the file holding it."""

    def __init__(self, files: Mapping[str, Path], where: str):
        self.where, self._files, self._open = where, dict(files), {}
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for path in sorted(set(self._files.values())):
            handle = self._handle(path)
            for name in handle.keys():
                if self._files.get(name) == path:
                    piece = handle.get_slice(name)
                    self._shapes[name] = (tuple(piece.get_shape()), SAFETENSORS_DTYPES[piece.get_dtype()])
        absent = [name for name in self._files if name not in self._shapes]
        if absent:
            raise ConfigError(f"{where}: {INDEX} places {', '.join(absent[:3])} in files that do not hold "
                              f"{'it' if len(absent) == 1 else 'them'}; copy the whole model directory")

    @classmethod
    def of_files(cls, paths: Iterable[Path], where: str) -> "SafetensorsSource":
        from safetensors import safe_open

        files = {}
        for path in paths:
            with safe_open(str(path), framework="pt") as handle:
                files.update({name: path for name in handle.keys()})
        return cls(files, where)

    def tensors(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._shapes)

    def read(self, name: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        handle = self._handle(self._files[name])
        if region is None or not self._shapes[name][0]:
            return self._count(handle.get_tensor(name))
        return self._count(handle.get_slice(name)[region].contiguous())

    def _handle(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def close(self) -> None:
        self._open.clear()


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
