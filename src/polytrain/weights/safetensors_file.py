"""A safetensors file written one tensor at a time, and a model's tensors planned into Hugging Face's shards.

safetensors' own ``save_file`` takes every tensor of a file at once, so a whole shard would have to sit in one
process. The format needs no more than its header to be known first: an 8-byte little-endian length, a JSON
header with each tensor's dtype, shape and byte offsets in the data, then the data. :class:`SafetensorsFile`
writes that header from the tensors' names, shapes and dtypes, then each tensor's bytes at its offset as it
comes (in any order), so a writer holds one tensor at a time. The file is written under a temporary name and
renamed into place when complete (:meth:`SafetensorsFile.finish`). safetensors reads the result
(``tests/weights/test_export.py`` checks it against ``safe_open`` and ``from_pretrained``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from polytrain.train.files import tmp_path

DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
DEFAULT_SHARD_BYTES = 5 * 10**9  # save_pretrained's shards of at most 5 GB


@dataclass(frozen=True)
class Entry:
    """One tensor of a file: its name, whole shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def read_header(path: str | Path) -> tuple[dict[str, dict], int]:
    """A safetensors file's header, read without mapping the file: each tensor's entry (``dtype``, ``shape``,
    ``data_offsets``) by name, and where its data begins; ValueError for a file that is not one."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", head)
        text = f.read(length)
    if len(text) != length:
        raise ValueError("its header is cut short")
    header = json.loads(text)
    header.pop("__metadata__", None)
    return header, 8 + length


def shard_name(k: int, n: int) -> str:
    """Hugging Face's name of shard ``k`` (1-based) of ``n``."""
    return f"model-{k:05d}-of-{n:05d}.safetensors"


def plan_shards(entries: list[Entry], max_bytes: int = DEFAULT_SHARD_BYTES,
                writers: list[frozenset[int]] | None = None) -> list[tuple[list[Entry], frozenset[int]]]:
    """``entries`` in order, cut into files of at most ``max_bytes`` each (a tensor larger than that alone in
    its file), each with the ranks that could write all of it: given ``writers`` (the ranks that can write
    each entry), a file also ends where no rank could write all of it."""
    files: list[tuple[list[Entry], frozenset[int]]] = []
    size = 0
    for i, entry in enumerate(entries):
        able = writers[i] if writers is not None else frozenset({0})
        if files and size + entry.nbytes <= max_bytes and files[-1][1] & able:
            files[-1] = (files[-1][0] + [entry], files[-1][1] & able)
            size += entry.nbytes
        else:
            files.append(([entry], able))
            size = entry.nbytes
    return files


class SafetensorsFile:
    """A safetensors file of ``entries`` (in that order in the data), its header written at once, each tensor's
    bytes written by :meth:`write` as it comes; complete and in place after :meth:`finish`."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None):
        self.path, self.tmp = Path(path), tmp_path(Path(path))
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for entry in entries:
            self.offsets[entry.name] = (start, start + entry.nbytes)
            header[entry.name] = {"dtype": DTYPES[entry.dtype], "shape": list(entry.shape),
                                  "data_offsets": [start, start + entry.nbytes]}
            start += entry.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # (the data starts 8-byte aligned)
        self.base, self.size = 8 + len(text), 8 + len(text) + start
        self.dtypes = {e.name: e.dtype for e in entries}
        self._written: set[str] = set()
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)  # (less the umask, as open() makes one)
        try:
            os.pwrite(self.fd, struct.pack("<Q", len(text)) + text, 0)
            os.ftruncate(self.fd, self.size)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Tensor ``name``'s values (converted to the file's dtype), at their place in the file."""
        start, end = self.offsets[name]
        data = tensor.detach().to("cpu", self.dtypes[name]).contiguous().reshape(-1).view(torch.uint8)
        assert data.numel() == end - start, (name, data.numel(), end - start)
        view, done = memoryview(data.numpy()), 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.base + start + done)
        self._written.add(name)

    def finish(self, place: bool = True) -> dict[str, object]:
        """Fsync the file and (``place``) rename it into place; its record for the index (file name, size,
        tensors). ``place=False``: complete under its temporary name until :meth:`place`."""
        missing = [name for name in self.offsets if name not in self._written]
        if missing:
            self.abort()
            raise RuntimeError(f"{self.path.name}: {len(missing)} tensor(s) never written ({', '.join(missing[:3])})")
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = -1
        if place:
            self.place()
        return {"file": self.path.name, "size": self.size, "tensors": list(self.offsets),
                "bytes": sum(end - start for start, end in self.offsets.values())}

    def place(self) -> None:
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        """Close and remove the temporary file (a file already in place is left)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tmp.unlink(missing_ok=True)
