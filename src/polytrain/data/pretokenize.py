"""Tokenizing documents into a token file (``polytrain tokenize``, and the cache of ``hf:`` data).

The inputs are cut into chunks (:mod:`polytrain.data.documents`); worker processes tokenize chunks, each into
a part file of its own under ``OUTPUT.parts/``, written whole (a temporary name renamed) with a small record
of its counts. A second run with the same inputs, tokenizer and field finds the parts done and tokenizes only
the rest, so an interrupted run resumes. The parts are then joined in chunk order into ``OUTPUT`` (again
under a temporary name, renamed at the end) with ``OUTPUT.json`` beside it, and the parts removed: the token
file is the same bytes whatever the number of processes, the chunks' order being fixed by the inputs alone.
Every document is followed by the tokenizer's end-of-document token.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import shutil
import sys
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

from polytrain.data import documents
from polytrain.data.documents import Chunk
from polytrain.data.token_meta import DTYPES, smallest_dtype, write_meta
from polytrain.data.tokenizer import cached_tokenizer, load_tokenizer
from polytrain.environ import environment
from polytrain.errors import ConfigError

_BATCH = 1024  # documents handed to the tokenizer at once


def _part(parts: Path, index: int) -> Path:
    return parts / f"{index:06d}.bin"


def tokenize_chunk(chunk: Chunk, field: str, split: str | None, tokenizer: str, dtype: str, target: Path,
                   what: str) -> dict[str, int]:
    """Tokenize one chunk into ``target`` (written whole, then its record ``target.json``); its counts."""
    encoder = cached_tokenizer(tokenizer)
    assert encoder is not None
    texts = documents.read(chunk, field, split, what)
    ids: list[int] = []
    for i in range(0, len(texts), _BATCH):
        for doc in encoder.documents(texts[i : i + _BATCH]):
            ids += doc
    array = np.asarray(ids, dtype=DTYPES[dtype])
    partial = target.with_name(target.name + ".partial")
    array.tofile(partial)
    partial.replace(target)
    record = {"tokens": len(array), "documents": len(texts), "max_id": int(array.max()) if len(array) else 0}
    target.with_name(target.name + ".json").write_text(json.dumps(record), encoding="utf-8")
    return record


def _job(args: tuple[Any, ...]) -> tuple[int, dict[str, int]]:
    index, chunk, field, split, tokenizer, dtype, parts, what = args
    return index, tokenize_chunk(Chunk(**chunk), field, split, tokenizer, dtype, _part(Path(parts), index), what)


def _done(parts: Path, index: int) -> dict[str, int] | None:
    record = _part(parts, index).with_name(_part(parts, index).name + ".json")
    if not record.is_file() or not _part(parts, index).is_file():
        return None
    try:
        return json.loads(record.read_text(encoding="utf-8"))
    except ValueError:
        return None


def plan_key(chunks: list[Chunk], fingerprint: str, field: str, split: str | None, dtype: str) -> str:
    described = json.dumps([[asdict(c) for c in chunks], fingerprint, field, split, dtype])
    return hashlib.sha256(described.encode("utf-8")).hexdigest()[:16]


def tokenize_files(inputs: list[str], tokenizer: str, output: str | Path, *, field: str = "text",
                   split: str | None = None, dtype: str | None = None, workers: int | None = None,
                   progress: Callable[[int, int], None] | None = None, what: str = "tokenize",
                   overwrite: bool = False) -> dict[str, Any]:
    """Write ``output`` (and ``output.json``) from ``inputs``; its metadata. ``progress(done, total)`` is
    called with bytes of input tokenized as chunks finish."""
    encoder = load_tokenizer(tokenizer)
    eos = encoder.require_eos()
    dtype = dtype or smallest_dtype(encoder.vocab_size)
    if dtype not in DTYPES:
        raise ConfigError(f"{what}: --dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    if DTYPES[dtype](0).itemsize * 8 < encoder.vocab_size.bit_length():
        raise ConfigError(f"{what}: --dtype {dtype} cannot hold the ids of a vocabulary of {encoder.vocab_size}; "
                          "use uint32")
    output = Path(output).expanduser()
    if output.exists() and not overwrite:
        raise ConfigError(f"{what}: {output} exists; remove it or give another --output")
    cut = documents.chunks(inputs, field, split, what)
    parts = output.with_name(output.name + ".parts")
    key = plan_key(cut, encoder.fingerprint, field, split, dtype)
    _prepare_parts(parts, key)
    todo = [i for i in range(len(cut)) if _done(parts, i) is None]
    total, done_bytes = sum(c.size for c in cut), sum(c.size for i, c in enumerate(cut) if i not in set(todo))
    if progress is not None:
        progress(done_bytes, total)
    workers = max(1, min(workers or documents.cpu_count(), len(todo)))
    jobs = [(i, asdict(cut[i]), field, split, tokenizer, dtype, str(parts), what) for i in todo]
    if workers == 1:
        for job in jobs:
            _job(job)
            done_bytes += cut[job[0]].size
            if progress is not None:
                progress(done_bytes, total)
    else:
        done_bytes = _run_pool(jobs, workers, cut, done_bytes, total, progress)
    records = [_done(parts, i) for i in range(len(cut))]
    assert all(r is not None for r in records)
    _join(parts, len(cut), output)
    meta_args = dict(dtype=dtype, tokens=sum(r["tokens"] for r in records), documents=sum(r["documents"] for r in records),
                     eos_id=eos, tokenizer=encoder, max_id=max((r["max_id"] for r in records), default=0),
                     sources=[str(Path(i).expanduser()) for i in inputs])
    write_meta(output, **meta_args)
    shutil.rmtree(parts, ignore_errors=True)
    return json.loads((output.with_name(output.name + ".json")).read_text(encoding="utf-8"))


def _prepare_parts(parts: Path, key: str) -> None:
    """The parts directory of this plan: kept (a resume) when it was made for the same plan, else emptied."""
    plan = parts / "plan"
    if parts.is_dir() and (not plan.is_file() or plan.read_text().strip() != key):
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    plan.write_text(key + "\n")


def _run_pool(jobs: list[tuple[Any, ...]], workers: int, cut: list[Chunk], done_bytes: int, total: int,
              progress: Callable[[int, int], None] | None) -> int:
    # one thread a process: the processes are the parallelism
    with environment({"TOKENIZERS_PARALLELISM": "false"}):
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            pending = {pool.submit(_job, job) for job in jobs}
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for future in finished:
                    if future.exception() is not None:
                        for other in pending:
                            other.cancel()
                        raise future.exception()  # type: ignore[misc]
                    done_bytes += cut[future.result()[0]].size
                    if progress is not None:
                        progress(done_bytes, total)
    return done_bytes


def _join(parts: Path, count: int, output: Path) -> None:
    partial = output.with_name(output.name + ".partial")
    with open(partial, "wb") as out:
        for i in range(count):
            with open(_part(parts, i), "rb") as part:
                shutil.copyfileobj(part, out, 1 << 22)
    partial.replace(output)


def bar(label: str) -> Callable[[int, int], None]:
    """A progress callback: a tqdm bar on a terminal, a line per tenth otherwise."""
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if sys.stderr.isatty():
            if "bar" not in state:
                from tqdm import tqdm
                state["bar"] = tqdm(total=total, unit="B", unit_scale=True, desc=label, dynamic_ncols=True)
            state["bar"].update(done - state["bar"].n)
            if done >= total:
                state["bar"].close()
            return
        tenth = done * 10 // max(total, 1)
        if tenth != state.get("tenth"):
            state["tenth"] = tenth
            print(f"{label}: {done * 100 // max(total, 1)}% of {total:,} bytes", file=sys.stderr, flush=True)

    return update
