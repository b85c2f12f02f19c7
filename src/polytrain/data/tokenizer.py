"""``--tokenizer DIR|FILE|text``: a real tokenizer for language-model data, on Hugging Face ``tokenizers``.

Bytes stay the default (vocabulary 256, no tokenizer at all). ``--tokenizer`` takes

- a ``tokenizer.json`` (Hugging Face ``tokenizers``' own file), or a directory holding one: a Hugging Face
  model directory, whose ``tokenizer_config.json`` also names the end-of-document token (``eos_token``);
- a SentencePiece ``.model`` file, or a directory holding ``tokenizer.model`` and no ``tokenizer.json``
  (``sentencepiece``);
- ``text``: the byte-level BPE of 1,024 tokens trained once on the shipped text (``tools/train_tokenizer.py``
  wrote ``text_tokenizer.json`` in the package), so the demo and tests need nothing from outside.

Text is encoded without special tokens; a document (a JSONL or Parquet row, a sentence, a text file given to
``polytrain tokenize``) ends with the end-of-document token, which packing (``--pack``) keeps attention and
the loss from crossing. Both libraries are imported only when a tokenizer is used.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

from polytrain.errors import ConfigError

SHIPPED = "text"
SHIPPED_FILE = "text_tokenizer.json"
#: special tokens taken as the end of a document when no tokenizer_config.json names one
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "[SEP]", "<|eot_id|>")


@dataclass
class Tokenizer:
    """What polytrain needs of a tokenizer: encode, decode, the vocabulary, the end-of-document id, and a
    fingerprint (a hash of the tokenizer's own file) that token files and caches are keyed by."""

    source: str
    vocab_size: int
    eos_id: int | None
    fingerprint: str
    _impl: Any = field(repr=False)
    _kind: str = field(default="hf", repr=False)

    def encode(self, text: str) -> list[int]:
        if self._kind == "sp":
            return list(self._impl.encode(text))
        return self._impl.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several texts at once (``tokenizers`` spreads them over its threads)."""
        if self._kind == "sp":
            return [list(ids) for ids in self._impl.encode(list(texts))]
        return [e.ids for e in self._impl.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self._kind == "sp":
            return self._impl.decode(ids)
        return self._impl.decode(ids, skip_special_tokens=False)

    def documents(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text as a document: its tokens and the end-of-document token."""
        end = [self.require_eos()]
        return [ids + end for ids in self.encode_batch(texts)]

    def require_eos(self) -> int:
        if self.eos_id is None:
            raise ConfigError(f"--tokenizer {self.source}: it has no end-of-document token (none of "
                              f"{', '.join(EOS_NAMES)}, and no eos_token in a tokenizer_config.json beside it); "
                              "add one to the tokenizer, or name it as eos_token in tokenizer_config.json")
        return self.eos_id

    def describe(self) -> str:
        eos = "none" if self.eos_id is None else f"{self.eos_id}"
        return f"tokenizer {self.source}: vocabulary {self.vocab_size}, end-of-document id {eos}"


def _hf_module():
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("--tokenizer needs the tokenizers package: pip install 'polytrain[tokenizers]' "
                          "(or leave --tokenizer out: bytes are the tokens)") from None
    return tokenizers


def shipped_tokenizer_json() -> str:
    return resources.files("polytrain.data").joinpath(SHIPPED_FILE).read_text(encoding="utf-8")


def _eos_from_config(directory: Path) -> str | None:
    """``eos_token`` of a Hugging Face ``tokenizer_config.json`` (a string, or a dict with ``content``)."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, OSError, AttributeError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _load_hf(text: str, source: str, directory: Path | None) -> Tokenizer:
    tokenizers = _hf_module()
    try:
        impl = tokenizers.Tokenizer.from_str(text)
    except Exception as exc:  # noqa: BLE001 - whatever the Rust parser says about a file that is not one
        reason = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--tokenizer {source}: not a tokenizers tokenizer.json ({reason}); give a tokenizer.json "
                          "(tokenizers' Tokenizer.save), a directory holding one, a SentencePiece .model, or "
                          "'text' (the shipped one)") from None
    named = _eos_from_config(directory) if directory is not None else None
    eos = impl.token_to_id(named) if named else None
    if eos is None:
        eos = next((impl.token_to_id(n) for n in EOS_NAMES if impl.token_to_id(n) is not None), None)
    fingerprint = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    return Tokenizer(source, impl.get_vocab_size(with_added_tokens=True), eos, fingerprint, impl, "hf")


def _load_sentencepiece(path: Path, source: str) -> Tokenizer:
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError(f"--tokenizer {source}: a SentencePiece model needs the sentencepiece package: "
                          "pip install 'polytrain[tokenizers]'") from None
    data = path.read_bytes()
    impl = sentencepiece.SentencePieceProcessor()
    try:
        impl.LoadFromSerializedProto(data)
    except Exception as exc:  # noqa: BLE001 - a file that is no SentencePiece model
        raise ConfigError(f"--tokenizer {source}: not a SentencePiece model ({type(exc).__name__}); give a "
                          "tokenizer.json, a directory holding one, or a SentencePiece .model") from None
    eos = impl.eos_id()
    return Tokenizer(source, impl.get_piece_size(), eos if eos >= 0 else None,
                     hashlib.sha256(data).hexdigest()[:16], impl, "sp")


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer ``spec`` names (see the module); one ConfigError line if it is none."""
    path = Path(spec).expanduser()
    if spec == SHIPPED and not path.exists():
        return _load_hf(shipped_tokenizer_json(), SHIPPED, None)
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return _load_hf(_read(path / "tokenizer.json", spec), spec, path)
        if (path / "tokenizer.model").is_file():
            return _load_sentencepiece(path / "tokenizer.model", spec)
        raise ConfigError(f"--tokenizer {spec}: the directory holds no tokenizer.json nor tokenizer.model; give "
                          "a tokenizer's file or the directory of a Hugging Face model saved with its tokenizer")
    if not path.is_file():
        raise ConfigError(f"--tokenizer {spec}: no such file or directory; give a tokenizer.json, a directory "
                          f"holding one, a SentencePiece .model, or '{SHIPPED}' (the shipped one)")
    if path.suffix == ".model":
        return _load_sentencepiece(path, spec)
    return _load_hf(_read(path, spec), spec, path.parent)


def _read(path: Path, spec: str) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"--tokenizer {spec}: {path.name} is not a tokenizer.json (not even UTF-8 text); give "
                          "a tokenizer.json, a directory holding one, or a SentencePiece .model") from None
    except OSError as exc:
        raise ConfigError(f"--tokenizer {spec}: cannot read {path} ({exc.strerror or exc})") from None


def has_tokenizer(directory: str | Path) -> bool:
    """Whether a directory (a Hugging Face model's) holds a tokenizer ``--tokenizer DIR`` would read."""
    d = Path(directory).expanduser()
    return (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()


def model_tokenizer(model: str | None) -> str | None:
    """The directory of ``--model hf:DIR`` when it holds a tokenizer (a run's default ``--tokenizer``)."""
    if not model or not model.startswith("hf:"):
        return None
    directory = model[len("hf:"):]
    return directory if has_tokenizer(directory) else None


_LOADED: dict[tuple[str, int], Tokenizer] = {}


def cached_tokenizer(spec: str | None) -> Tokenizer | None:
    """:func:`load_tokenizer`, once per process for a file that has not changed since; None for None (bytes)."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    target = path / "tokenizer.json" if path.is_dir() else path
    try:
        stamp = target.stat().st_mtime_ns
    except OSError:
        stamp = -1
    key = (str(spec), stamp)
    if key not in _LOADED:
        _LOADED[key] = load_tokenizer(str(spec))
    return _LOADED[key]
