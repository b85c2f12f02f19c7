"""``hf:DIR|FILE.jsonl|FILE.parquet``: local Hugging Face-style data, tokenized once and cached next to it.

``PATH`` is a dataset saved with ``datasets``' ``save_to_disk`` (``split=`` of a ``DatasetDict``, default
``train``; needs ``datasets``), a JSON Lines file (one object a line) or a Parquet file (needs ``pyarrow``);
``field=`` names the text (default ``text``). Nothing is ever fetched from a hub.

The documents are tokenized with ``--tokenizer`` (each followed by its end-of-document token) by
:func:`polytrain.data.pretokenize.tokenize_files`, in processes, before the run starts, into a token file
cached in ``.polytrain-cache/`` beside ``PATH`` (or in ``cache=DIR``), named by a key of the tokenizer (its
fingerprint), the field, the split and the inputs' paths, sizes and modification times: a second run, or the
workers of this one, map it in no time, and a change to any of them tokenizes again. Tokenizing ahead with
``polytrain tokenize`` and training on ``--data tokens:FILE.bin,windows=documents`` is the same.

Each document is its own sequence (a long one cut into pieces of ``seq_len``), padded to the batch's longest;
with ``--pack``, whole documents are packed into sequences of ``seq_len``, attention and loss kept within
each. The test split is ``test_file=PATH`` (tokenized the same way) or the last ``test_fraction`` (0.1) of
the tokens, cut at a document's end.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from pathlib import Path
from typing import Iterator

from polytrain.data import documents
from polytrain.data.base import DataBundle
from polytrain.data.token_file import TEST_FRACTION, bundle, load
from polytrain.data.tokenizer import cached_tokenizer
from polytrain.errors import ConfigError, DataError

CACHE = ".polytrain-cache"
_VERSION = 1


def _check(path: str | None, tokenizer: str | None) -> str:
    if path is None:
        raise DataError("hf: name the data, e.g. --data hf:train.jsonl or hf:saved_dataset_dir")
    if tokenizer is None:
        raise ConfigError(f"hf:{path}: the documents are text: give --tokenizer (a tokenizer.json, a model's "
                          "directory, or 'text')")
    return str(path)


def cache_file(path: str, tokenizer: str, field: str, split: str | None, cache: str | None) -> Path:
    """Where the tokens of ``path`` are cached for these settings."""
    encoder = cached_tokenizer(tokenizer)
    assert encoder is not None
    key = json.dumps([_VERSION, encoder.fingerprint, field, split, documents.signature([path])])
    digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:16]
    source = Path(path).expanduser().resolve()
    where = Path(cache).expanduser() if cache else source.parent / CACHE
    return where / f"{source.name.replace('*', '_')}-{digest}.bin"


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """Hold ``lock`` (one process tokenizes; the others wait for it, never for a process that died: the
    kernel releases a dead holder's lock)."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as fh:
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def tokenized(path: str, tokenizer: str, field: str, split: str | None, cache: str | None) -> Path:
    """The cached token file of ``path``, tokenized now if it is not there yet."""
    from polytrain.data.pretokenize import bar, tokenize_files

    target = cache_file(path, tokenizer, field, split, cache)
    if target.is_file() and Path(str(target) + ".json").is_file():
        return target
    try:
        with _locked(target.with_name(target.name + ".lock")):
            if not target.is_file():
                tokenize_files([path], tokenizer, target, field=field, split=split,
                               progress=bar(f"hf:{Path(path).name}: tokenizing"), what=f"hf:{path}", overwrite=True)
    except PermissionError:
        raise ConfigError(f"hf:{path}: cannot write the tokenized cache in {target.parent}; give cache=DIR "
                          "somewhere writable, or tokenize ahead with polytrain tokenize") from None
    return target


def _load(path: str | None, field: str, split: str | None, seq_len: int, test_fraction: float,
          test_file: str | None, cache: str | None, tokenizer: str | None, pack: bool, seed: int):
    source = _check(path, tokenizer)
    assert tokenizer is not None
    train = tokenized(source, tokenizer, field, split, cache)
    test = str(tokenized(test_file, tokenizer, field, split, cache)) if test_file else None
    return load(str(train), None, seq_len, None, "documents", test_fraction, test, None, tokenizer, pack, seed,
                what=f"hf:{source}")


def check_hf(path: str | None = None, field: str = "text", split: str | None = None, seq_len: int = 128,
             test_fraction: float = TEST_FRACTION, test_file: str | None = None, cache: str | None = None,
             stream: bool = False, lanes: int | None = None, tokenizer: str | None = None, pack: bool = False
             ) -> int | None:
    """Tokenize (once, into the cache) and validate; the number of training sequences (None: a stream)."""
    made = hf(path, field, split, seq_len, test_fraction, test_file, cache, stream, lanes, tokenizer, pack)
    return None if stream else len(made.train)


def hf(path: str | None = None, field: str = "text", split: str | None = None, seq_len: int = 128,
       test_fraction: float = TEST_FRACTION, test_file: str | None = None, cache: str | None = None,
       stream: bool = False, lanes: int | None = None, tokenizer: str | None = None, pack: bool = False,
       run_seed: int = 0) -> DataBundle:
    """The documents of ``path`` as language-model sequences (see the module); ``stream=true``: read and
    tokenized as training goes (:mod:`polytrain.data.stream`)."""
    if not stream:
        loaded = _load(path, field, split, seq_len, test_fraction, test_file, cache, tokenizer, pack, run_seed)
        return bundle(f"hf:{path}", *loaded, seq_len, pack)
    return _stream(_check(path, tokenizer), field, split, seq_len, test_file, cache, lanes, tokenizer, pack,
                   run_seed)


def _stream(path: str, field: str, split: str | None, seq_len: int, test_file: str | None, cache: str | None,
            lanes: int | None, tokenizer: str | None, pack: bool, seed: int) -> DataBundle:
    from polytrain.data.stream import TokenStream

    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise DataError(f"hf:{path}: seq_len must be an integer >= 1, got {seq_len!r}")
    if lanes is not None and (isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1):
        raise DataError(f"hf:{path}: lanes must be an integer >= 1, got {lanes!r}")
    assert tokenizer is not None
    encoder = cached_tokenizer(tokenizer)
    assert encoder is not None
    train = TokenStream([path], field, split, tokenizer, seq_len, pack, seed, lanes, name=f"hf:{path}")
    train.eos  # (a tokenizer without an end-of-document token is refused here, before anything starts)
    documents.resolve_inputs(train.inputs, train.name)  # (the files themselves: when the lanes are known)
    test = None
    if test_file:
        made = tokenized(test_file, tokenizer, field, split, cache)
        test = load(str(made), None, seq_len, None, "sequential", TEST_FRACTION, str(made), None, tokenizer, pack,
                    seed, what=f"hf:{test_file}")[1]
    return DataBundle(name=f"hf:{path}", train=train, test=test, input_shape=(seq_len,),
                      num_classes=encoder.vocab_size, task="lm", default_model="transformer_lm",
                      vocab_size=encoder.vocab_size, seq_len=seq_len, document_end=train.eos if pack else None)
