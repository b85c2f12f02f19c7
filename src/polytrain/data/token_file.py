"""``tokens:FILE.bin``: a pre-tokenized corpus, memory-mapped (nanoGPT's and Megatron's flat ``.bin``).

The file is the token ids back to back, little-endian ``uint16`` (vocabularies up to 65,536) or ``uint32``,
nothing else. ``polytrain tokenize`` writes one, with ``FILE.bin.json`` beside it saying its dtype, its
tokenizer (source and fingerprint), vocabulary, end-of-document id, largest id and its documents; a bare
``.bin`` from elsewhere works too (``dtype=`` if not ``uint16``; its largest id is then read once).

The file is mapped read-only, never loaded: a step reads only the pages of its windows, and a mapped file
counts against neither a worker's ``--memory-limit`` nor its private memory. Examples:

- ``tokens:train.bin,seq_len=256``: windows of 256 tokens every ``stride`` (default ``seq_len``) tokens,
  their order shuffled each epoch like any dataset's;
- ``windows=random``: as many windows, at random offsets drawn afresh each epoch (nanoGPT's sampling);
- ``windows=documents``: each document its own sequence (a long one cut into pieces of ``seq_len``), padded
  to the batch's longest;
- with ``--pack``: whole documents (each ends with the end-of-document token: ``eos=``, else the file's own
  or ``--tokenizer``'s) packed into sequences of ``seq_len`` by best fit, attention and loss kept within each;
- ``test_file=val.bin`` for a separate validation file, else the last ``test_fraction`` (0.1) of the tokens
  (cut at a document's end when packing) is held out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.data.base import DataBundle
from polytrain.data.spans import Spans, TokenWindows, document_ends, documents, max_token
from polytrain.data.spans import pack as pack_documents
from polytrain.data.token_meta import DTYPES, meta_path, read_meta
from polytrain.data.tokenizer import Tokenizer, cached_tokenizer
from polytrain.data.tokens import check_fraction
from polytrain.errors import ConfigError, DataError

WINDOWS = ("sequential", "random", "documents")
TEST_FRACTION = 0.1


@dataclass
class TokenFile:
    """A token file mapped read-only: ``tokens`` (a NumPy memmap) and what its metadata says."""

    path: Path
    tokens: np.ndarray
    meta: dict[str, Any]

    @property
    def max_id(self) -> int:
        if "max_id" not in self.meta:
            self.meta["max_id"] = max_token(self.tokens)
        return int(self.meta["max_id"])


def open_tokens(file: str | Path, dtype: str | None = None) -> TokenFile:
    """Map ``file``; one DataError line if it is missing, empty, not a whole number of ``dtype`` tokens, or its
    metadata says another dtype."""
    path = Path(file).expanduser()
    if not path.is_file():
        raise DataError(f"tokens: no file {path}" + (" (it is a directory)" if path.is_dir() else "") +
                        "; give a token file (polytrain tokenize writes one)")
    meta = read_meta(path)
    if dtype is not None and dtype not in DTYPES:
        raise DataError(f"tokens: dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if dtype is not None and meta.get("dtype") not in (None, dtype):
        raise DataError(f"tokens: {path} holds {meta['dtype']} tokens (its {meta_path(path).name} says so), not "
                        f"{dtype}; leave dtype= out")
    chosen = dtype or meta.get("dtype") or "uint16"
    size, width = path.stat().st_size, np.dtype(DTYPES[chosen]).itemsize
    if size == 0:
        raise DataError(f"tokens: {path} is empty; give a token file with tokens in it")
    if size % width:
        raise DataError(f"tokens: {path} has {size} bytes, not a whole number of {chosen} tokens ({width} bytes "
                        "each): a damaged file, or another dtype (dtype=uint16|uint32)")
    return TokenFile(path, np.memmap(path, dtype=DTYPES[chosen], mode="r"), meta)


def _check_args(seq_len: Any, stride: Any, windows: str, test_fraction: float) -> int:
    for name, value in (("seq_len", seq_len), ("stride", stride if stride is not None else 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DataError(f"tokens: {name} must be an integer >= 1, got {value!r}")
    if windows not in WINDOWS:
        raise DataError(f"tokens: windows must be one of {', '.join(WINDOWS)}, got {windows!r}")
    check_fraction(test_fraction, "tokens")
    return seq_len if stride is None else stride


def check_tokenizer(meta: dict[str, Any], tokenizer: Tokenizer | None, what: str) -> None:
    """One ConfigError line if ``--tokenizer`` is not the tokenizer the file's metadata names."""
    made = meta.get("tokenizer") or {}
    if tokenizer is not None and made.get("fingerprint") not in (None, tokenizer.fingerprint):
        raise ConfigError(f"--tokenizer {tokenizer.source}: {what} was tokenized with another tokenizer "
                          f"({made.get('source')}); give that one, or tokenize again with this one")


def end_of_document(eos: int | None, meta: dict[str, Any], tokenizer: Tokenizer | None, what: str) -> int:
    """The end-of-document id: ``eos=``, else the file's metadata's, else the tokenizer's."""
    for value in (eos, meta.get("eos_id"), tokenizer.eos_id if tokenizer is not None else None):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise DataError(f"{what}: eos must be a token id >= 0, got {value!r}")
            return value
    raise ConfigError(f"--pack: {what} does not say which token ends a document; give eos=ID (or the "
                      "--tokenizer it was made with)")


def _split(file: TokenFile, test_file: str | None, test_fraction: float, eos: int | None
           ) -> tuple[np.ndarray, np.ndarray]:
    tokens = file.tokens
    if test_file is not None:
        return tokens, open_tokens(test_file, file.meta.get("dtype")).tokens
    cut = int(len(tokens) * (1 - test_fraction))
    if eos is not None:  # packed documents: cut after the first end of a document from there
        found = np.flatnonzero(np.asarray(tokens[cut:]) == eos)
        cut = cut + int(found[0]) + 1 if len(found) else len(tokens)
    return tokens[:cut], tokens[cut:]


def _sequences(tokens: np.ndarray, seq_len: int, stride: int, windows: str, seed: int, eos: int | None,
               pack: bool, max_id: int | None, split: str, what: str) -> TokenWindows | Spans:
    if not pack and windows != "documents":
        if len(tokens) < seq_len + 1:
            raise DataError(f"{what}: its {split} split has {len(tokens)} tokens, too few for a window of seq_len "
                            f"{seq_len}; use a smaller seq_len, test_fraction or a longer file")
        return TokenWindows(tokens, seq_len, stride, random=windows == "random", seed=seed)
    assert eos is not None
    ends = document_ends(tokens, eos)
    if pack:
        starts, stops, rows = pack_documents(ends, seq_len, ended=len(tokens) > 0 and int(tokens[-1]) == eos)
    else:
        (starts, stops), rows = documents(ends, seq_len), None
    if len(starts) == 0:
        raise DataError(f"{what}: its {split} split holds no document of two tokens or more; use more data")
    return Spans(tokens, starts, stops, eos, rows, pad_to=seq_len if pack else None, max_id=max_id)


def load(file: str | None, dtype: str | None, seq_len: int, stride: int | None, windows: str,
         test_fraction: float, test_file: str | None, eos: int | None, tokenizer: str | None, pack: bool,
         seed: int, what: str = "") -> tuple[TokenWindows | Spans, TokenWindows | Spans, TokenFile, Tokenizer | None]:
    """(train, test) sequences of a token file, the file, and the tokenizer (see the module)."""
    if file is None:
        raise DataError("tokens: name the file, e.g. --data tokens:train.bin (polytrain tokenize writes one)")
    what = what or f"tokens:{file}"
    stride = _check_args(seq_len, stride, windows, test_fraction)
    source = open_tokens(file, dtype)
    encoder = cached_tokenizer(tokenizer)
    check_tokenizer(source.meta, encoder, what)
    if pack and windows == "random":
        raise DataError(f"{what}: --pack lays whole documents into the sequences; leave windows=random out")
    documented = pack or windows == "documents"
    end = end_of_document(eos, source.meta, encoder, what) if documented else None
    train, test = _split(source, test_file, test_fraction, end)
    max_id = source.meta.get("max_id")
    return (_sequences(train, seq_len, stride, windows, seed, end, pack, max_id, "training", what),
            _sequences(test, seq_len, stride, "documents" if windows == "documents" else "sequential", seed, end,
                       pack, max_id, "test", what),
            source, encoder)


def check_tokens(file: str | None = None, dtype: str | None = None, seq_len: int = 128, stride: int | None = None,
                 windows: str = "sequential", test_fraction: float = TEST_FRACTION, test_file: str | None = None,
                 eos: int | None = None, tokenizer: str | None = None, pack: bool = False) -> int:
    """Validate the file(s) and arguments; the number of training sequences."""
    return len(load(file, dtype, seq_len, stride, windows, test_fraction, test_file, eos, tokenizer, pack, 0)[0])


def tokens(file: str | None = None, dtype: str | None = None, seq_len: int = 128, stride: int | None = None,
           windows: str = "sequential", test_fraction: float = TEST_FRACTION, test_file: str | None = None,
           eos: int | None = None, tokenizer: str | None = None, pack: bool = False, run_seed: int = 0
           ) -> DataBundle:
    """The token file's sequences (see the module)."""
    loaded = load(file, dtype, seq_len, stride, windows, test_fraction, test_file, eos, tokenizer, pack, run_seed)
    return bundle(f"tokens:{file}", *loaded, seq_len, pack)


def bundle(name: str, train: TokenWindows | Spans, test: TokenWindows | Spans, source: TokenFile,
           encoder: Tokenizer | None, seq_len: int, pack: bool) -> DataBundle:
    vocab = source.meta.get("vocab_size") or (encoder.vocab_size if encoder is not None else None)
    if vocab is None:
        vocab = source.max_id + 1
    return DataBundle(name=name, train=train, test=test, input_shape=(seq_len,), num_classes=int(vocab),
                      task="lm", default_model="transformer_lm", vocab_size=int(vocab), seq_len=seq_len,
                      document_end=train.document_end if pack else None)
