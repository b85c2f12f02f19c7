"""The metadata of a token file: ``FILE.bin.json``, which ``polytrain tokenize`` writes beside ``FILE.bin``.

Kept apart from :mod:`polytrain.data.token_file` (and free of torch) so that tokenizing processes stay light.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from polytrain.data.tokenizer import Tokenizer
from polytrain.errors import DataError

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
META_SUFFIX = ".json"
FORMAT = "polytrain-tokens"


def meta_path(path: str | Path) -> Path:
    return Path(str(path) + META_SUFFIX)


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``FILE.bin.json`` that ``polytrain tokenize`` wrote beside a token file ({} where there is none)."""
    meta = meta_path(path)
    if not meta.is_file():
        return {}
    try:
        found = json.loads(meta.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise DataError(f"tokens: {meta} is not the JSON polytrain tokenize writes ({exc}); remove it, or "
                        "tokenize again") from None
    return found if isinstance(found, dict) and found.get("format") == FORMAT else {}


def write_meta(path: str | Path, dtype: str, tokens: int, documents: int, eos_id: int | None,
               tokenizer: Tokenizer | None, max_id: int, sources: list[str]) -> None:
    """``FILE.bin.json``, written whole or not at all."""
    meta = {"format": FORMAT, "version": 1, "dtype": dtype, "tokens": tokens, "documents": documents,
            "eos_id": eos_id, "max_id": max_id, "vocab_size": tokenizer.vocab_size if tokenizer else max_id + 1,
            "tokenizer": {"source": tokenizer.source, "fingerprint": tokenizer.fingerprint} if tokenizer else None,
            "sources": sources}
    target = meta_path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")
    partial.replace(target)


def smallest_dtype(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"
