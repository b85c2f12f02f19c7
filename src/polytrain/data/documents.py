"""Where documents come from: text files, JSON Lines, Parquet and Hugging Face datasets saved to disk, read in
chunks that processes (``polytrain tokenize``) or ranks (streaming) share out without anyone reading it all.

| input | a document | a chunk |
|---|---|---|
| ``FILE.txt`` (any other name) | the whole file | the file |
| ``FILE.jsonl`` / ``.json`` (one object a line) | a line's ``field`` (default ``text``) | a byte range: the lines that begin in it |
| ``FILE.parquet`` | a row's ``field`` column | a few row groups |
| ``DIR`` (``datasets``' ``save_to_disk``) | a row's ``field`` of split ``split`` | a range of rows |

A directory is read with ``datasets.load_from_disk`` (memory-mapped Arrow, nothing written); JSON Lines are
read directly and Parquet with ``pyarrow`` (what ``datasets`` itself reads it with), by byte ranges and row
groups, so several processes share one big file and an error names its line. Nothing is read from a hub.
Chunks are fixed by the inputs alone, so whatever reads them in whatever parallel, their documents in chunk
order are the same.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polytrain.errors import ConfigError, DataError

CHUNK_BYTES = 16 << 20  # a JSON Lines chunk: about this many bytes
CHUNK_ROWS = 8192  # a saved dataset's chunk: this many rows
JSONL = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class Chunk:
    """Part of one input: a byte range (JSON Lines), a row-group range (Parquet), a row range (a saved
    dataset), or the whole of a text file."""

    path: str
    kind: str  # text | jsonl | parquet | saved
    start: int
    stop: int
    size: int  # about how many bytes it holds (for progress)


def kind_of(path: Path) -> str:
    if path.is_dir():
        return "saved"
    suffix = path.suffix.lower()
    if suffix in JSONL:
        return "jsonl"
    if suffix == ".parquet":
        return "parquet"
    return "text"


def _datasets(what: str):
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{what}: a saved Hugging Face dataset needs the datasets package: pip install "
                          "'polytrain[datasets]'") from None
    return datasets


def _pyarrow_parquet(what: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"{what}: Parquet files need the pyarrow package: pip install 'polytrain[datasets]'") \
            from None
    return pq


def load_saved(path: str, split: str | None, what: str) -> Any:
    """The ``datasets.Dataset`` saved in ``path`` (a ``DatasetDict``'s ``split``)."""
    datasets = _datasets(what)
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # noqa: BLE001 - whatever datasets says of a directory that is not a saved dataset
        raise DataError(f"{what}: {path} is not a dataset saved with datasets' save_to_disk "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''})") from None
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        if name not in loaded:
            raise DataError(f"{what}: {path} has no split '{name}'; its splits: {', '.join(loaded)} (split=NAME)")
        return loaded[name]
    if split not in (None, "train"):
        raise DataError(f"{what}: {path} is one dataset with no splits; leave split= out")
    return loaded


def resolve_inputs(inputs: list[str], what: str) -> list[Path]:
    """The input paths, each existing, a pattern (``shards/*.jsonl``) standing for its matches in sorted order;
    one DataError line for one that does not exist or matches nothing."""
    if not inputs:
        raise DataError(f"{what}: no input; give a JSON Lines, Parquet or text file, or a saved dataset's directory")
    paths = []
    for item in _expand(inputs, what):
        path = Path(item).expanduser()
        if not path.exists():
            raise DataError(f"{what}: no file or directory {path}")
        if path.is_file() and path.stat().st_size == 0:
            raise DataError(f"{what}: {path} is empty; give a file with documents in it")
        paths.append(path)
    return paths


def _expand(inputs: list[str], what: str) -> list[str]:
    import glob

    out: list[str] = []
    for item in inputs:
        pattern = str(Path(item).expanduser())
        if glob.has_magic(pattern):
            found = sorted(glob.glob(pattern))
            if not found:
                raise DataError(f"{what}: no file matches {item}")
            out += found
        else:
            out.append(item)
    return out


def chunks(inputs: list[str], field: str, split: str | None, what: str, *, chunk_bytes: int | None = None,
           chunk_rows: int | None = None, groups: int | None = None) -> list[Chunk]:
    """Every input's chunks, in order; the field is checked where that costs no full read (a Parquet
    schema, a saved dataset's columns, each JSON Lines file's first line). ``chunk_bytes`` (JSON Lines),
    ``chunk_rows`` (saved datasets) and ``groups`` (Parquet row groups) size them (default: the module's)."""
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    chunk_rows = chunk_rows or CHUNK_ROWS
    out: list[Chunk] = []
    for path in resolve_inputs(inputs, what):
        kind = kind_of(path)
        if kind == "text":
            size = path.stat().st_size
            out.append(Chunk(str(path), kind, 0, size, size))
        elif kind == "jsonl":
            size = path.stat().st_size
            _check_first_line(path, field, what)
            out += [Chunk(str(path), kind, a, min(a + chunk_bytes, size), min(chunk_bytes, size - a))
                    for a in range(0, size, chunk_bytes)]
        elif kind == "parquet":
            pq = _pyarrow_parquet(what)
            try:
                meta = pq.ParquetFile(path).metadata
            except Exception as exc:  # noqa: BLE001 - a file pyarrow cannot read as Parquet
                raise DataError(f"{what}: {path} is not a Parquet file ({type(exc).__name__})") from None
            names = meta.schema.names
            if field not in names:
                raise DataError(f"{what}: {path} has no column '{field}' (its columns: {', '.join(names)}); name "
                                "the text's column with field=NAME")
            count = meta.num_row_groups
            per = groups or max(1, count // 64)
            out += [Chunk(str(path), kind, g, min(g + per, count),
                          sum(meta.row_group(i).total_byte_size for i in range(g, min(g + per, count))))
                    for g in range(0, count, per)]
        else:
            data = load_saved(str(path), split, what)
            if field not in data.column_names:
                raise DataError(f"{what}: {path} has no column '{field}' (its columns: "
                                f"{', '.join(data.column_names)}); name the text's column with field=NAME")
            rows, size = len(data), max(1, data.data.nbytes)
            out += [Chunk(str(path), kind, a, min(a + chunk_rows, rows), size * min(chunk_rows, rows - a) // max(rows, 1))
                    for a in range(0, rows, chunk_rows)]
    return out


def _check_first_line(path: Path, field: str, what: str) -> None:
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                _text_of(line, field, path, number, what)
                return


def _text_of(line: bytes, field: str, path: Path | str, number: int, what: str) -> str:
    try:
        record = json.loads(line)
    except ValueError as exc:
        raise DataError(f"{what}: {path} line {number} is not JSON ({exc}); give one JSON object a line") from None
    if not isinstance(record, dict) or field not in record:
        fields = ", ".join(record) if isinstance(record, dict) else f"a {type(record).__name__}, not an object"
        raise DataError(f"{what}: {path} line {number} has no field '{field}' (it has: {fields}); name the "
                        "text's field with field=NAME")
    value = record[field]
    if not isinstance(value, str):
        raise DataError(f"{what}: {path} line {number}: field '{field}' holds a {type(value).__name__}, not text")
    return value


def read(chunk: Chunk, field: str, split: str | None, what: str, skip: int = 0) -> list[str]:
    """The documents of ``chunk``, in order, from its ``skip``-th on."""
    if chunk.kind == "text":
        data = Path(chunk.path).read_bytes()
        try:
            return [data.decode("utf-8")][skip:]
        except UnicodeDecodeError as exc:
            raise DataError(f"{what}: {chunk.path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset "
                            f"{exc.start})") from None
    if chunk.kind == "jsonl":
        return [text for _, text in jsonl_lines(chunk, field, what)][skip:]
    if chunk.kind == "parquet":
        pq = _pyarrow_parquet(what)
        table = pq.ParquetFile(chunk.path).read_row_groups(list(range(chunk.start, chunk.stop)), columns=[field])
        return [_str(v, chunk, field, what) for v in table.column(field).to_pylist()[skip:]]
    data = load_saved(chunk.path, split, what)
    return [_str(v, chunk, field, what) for v in data[chunk.start + skip : chunk.stop][field]]


def _str(value: Any, chunk: Chunk, field: str, what: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"{what}: {chunk.path}: a row's '{field}' holds {type(value).__name__}, not text")
    return value


def jsonl_lines(chunk: Chunk, field: str, what: str) -> list[tuple[int, str]]:
    """(byte offset, text) of each non-blank line that begins in the chunk's byte range."""
    out: list[tuple[int, str]] = []
    with open(chunk.path, "rb") as fh:
        at = chunk.start
        if at > 0:  # a line that began before the range belongs to the chunk before
            fh.seek(at - 1)
            at += len(fh.readline()) - 1
        while at < chunk.stop:
            line = fh.readline()
            if not line:
                break
            if line.strip():
                try:
                    out.append((at, _text_of(line, field, chunk.path, 0, what)))
                except DataError:
                    _text_of(line, field, chunk.path, _line_number(chunk.path, at), what)
            at += len(line)
    return out


def _line_number(path: str, offset: int) -> int:
    """The 1-based number of the line at byte ``offset`` (counted only to name a bad line)."""
    count = 1
    with open(path, "rb") as fh:
        while offset > 0:
            block = fh.read(min(offset, 1 << 20))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def signature(inputs: list[str]) -> list[list[Any]]:
    """What a cache of these inputs is keyed by: each input's resolved path, size and modification time (a
    directory's: its files')."""
    out: list[list[Any]] = []
    for item in _expand(inputs, "cache"):
        path = Path(item).expanduser().resolve()
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for f in files:
            stat = f.stat()
            out.append([str(f), stat.st_size, stat.st_mtime_ns])
    return out


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
