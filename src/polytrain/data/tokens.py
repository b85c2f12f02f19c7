"""Byte-level tokens for language-model data: reading UTF-8 files, the padding id, encode/decode.

Tokens are the bytes of the UTF-8 text (vocabulary 256), so no tokenizer is needed and any file works;
a character outside ASCII is simply several tokens.

Padding: a batch of sequences of different lengths is padded to its longest sequence. Padded *targets*
hold :data:`IGNORE_INDEX` (-100, PyTorch's ``cross_entropy`` default ``ignore_index``), which the ``lm``
task leaves out of the loss, the accuracy and the token count. Padded *inputs* hold :data:`INPUT_PAD` (0),
a valid embedding index: -100 must never reach an ``nn.Embedding``. Padding sits after a sequence's real
tokens, so a causal model's outputs at real positions never see it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from polytrain.errors import DataError

VOCAB_SIZE = 256
IGNORE_INDEX = -100
INPUT_PAD = 0


def encode(text: str) -> torch.Tensor:
    """The UTF-8 bytes of ``text`` as a uint8 tensor."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def decode(tokens: torch.Tensor | list[int]) -> str:
    """Bytes back to text; a sequence cut inside a multi-byte character shows U+FFFD there."""
    values = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
    return bytes(int(v) for v in values).decode("utf-8", errors="replace")


def read_utf8(path: str | Path, what: str) -> bytes:
    """The bytes of a non-empty UTF-8 file, or one DataError line saying what is wrong with it.

    ``what`` names the dataset in the message (``text``, ``sentences``).
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"{what}: no file {file}" + (" (it is a directory)" if file.is_dir() else ""))
    data = file.read_bytes()
    if not data.strip():
        raise DataError(f"{what}: {file} is empty (or only blank lines); give a file with some text")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{what}: {file} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                        f"convert it, e.g. iconv -f latin1 -t utf-8 {file.name}") from None
    return data


def check_fraction(value: float, what: str) -> float:
    if not isinstance(value, (int, float)) or not 0 < value < 1:
        raise DataError(f"{what}: test_fraction must be a number between 0 and 1 (exclusive), got {value}")
    return float(value)
