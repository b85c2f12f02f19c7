"""``text`` and ``text:FILE``: a language model's fixed-length windows over one stream of tokens.

``text`` is the English text shipped in the package: Ambrose Bierce, *The Devil's Dictionary* (1911),
public domain, about 380 KB (``tools/export_text.py`` wrote ``devils_dictionary.txt.gz`` once from Debian's
``dict-devil`` package). ``text:FILE`` reads your own UTF-8 file the same way.

The tokens are the file's bytes, or with ``--tokenizer`` (:mod:`polytrain.data.tokenizer`) the ids of the whole
text encoded at once, exactly as the tokenizer itself encodes it.
The tokens are split once, not shuffled: the first ``1 - test_fraction`` for training, the rest for testing,
so no test window overlaps a training one. Example ``i`` of a split is the ``seq_len + 1`` tokens from
``i * stride``; its input is the first ``seq_len`` and its target the last ``seq_len`` (the input shifted by
one: each position predicts the next byte). Every target token is real, so nothing is padded.
Examples: ``text``, ``text:seq_len=64``, ``text:~/corpus.txt,seq_len=256,stride=128``.
"""

from __future__ import annotations

import gzip
from importlib import resources

import torch

from polytrain.data.base import DataBundle
from polytrain.data.spans import TokenWindows
from polytrain.data.tokenizer import Tokenizer, cached_tokenizer
from polytrain.data.tokens import VOCAB_SIZE, check_fraction, read_utf8
from polytrain.errors import DataError

SHIPPED = "devils_dictionary.txt.gz"
TEST_FRACTION = 0.1


def shipped_text() -> bytes:
    """The packaged book, as UTF-8 (in fact ASCII) bytes."""
    try:
        return gzip.decompress(resources.files("polytrain.data").joinpath(SHIPPED).read_bytes())
    except (FileNotFoundError, OSError, EOFError) as exc:
        raise DataError(f"text: the packaged file {SHIPPED} is missing or damaged ({exc}); reinstall polytrain") \
            from None


def _check_args(seq_len: int, stride: int | None, test_fraction: float) -> int:
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise DataError(f"text: seq_len must be an integer >= 1, got {seq_len}")
    stride = seq_len if stride is None else stride
    if not isinstance(stride, int) or isinstance(stride, bool) or stride < 1:
        raise DataError(f"text: stride must be an integer >= 1, got {stride}")
    check_fraction(test_fraction, "text")
    return stride


def _splits(file: str | None, seq_len: int, stride: int, test_fraction: float, tokenizer: Tokenizer | None
            ) -> tuple[TokenWindows, TokenWindows]:
    data = shipped_text() if file is None else read_utf8(file, "text")
    if tokenizer is None:
        tokens, unit = torch.frombuffer(bytearray(data), dtype=torch.uint8), "bytes"
    else:
        tokens, unit = torch.tensor(tokenizer.encode(data.decode("utf-8")), dtype=torch.int32), "tokens"
    cut = int(len(tokens) * (1 - test_fraction))
    source = "the packaged text" if file is None else file
    if min(cut, len(tokens) - cut) < seq_len + 1:
        raise DataError(f"text: {source} has {len(tokens)} {unit}, too few for train and test windows of "
                        f"seq_len {seq_len}; use a smaller seq_len or a longer file")
    return TokenWindows(tokens[:cut], seq_len, stride), TokenWindows(tokens[cut:], seq_len, stride)


def check_text(file: str | None = None, seq_len: int = 128, stride: int | None = None,
               test_fraction: float = TEST_FRACTION, tokenizer: str | None = None) -> int:
    """Validate arguments and file (exists, not empty, UTF-8, long enough); the number of training windows."""
    stride = _check_args(seq_len, stride, test_fraction)
    return len(_splits(file, seq_len, stride, test_fraction, cached_tokenizer(tokenizer))[0])


def text(file: str | None = None, seq_len: int = 128, stride: int | None = None,
         test_fraction: float = TEST_FRACTION, tokenizer: str | None = None) -> DataBundle:
    """Windows of ``seq_len`` tokens (every ``stride`` tokens, default ``seq_len``: no overlap); bytes unless
    ``tokenizer`` (``--tokenizer``) names one."""
    stride = _check_args(seq_len, stride, test_fraction)
    encoder = cached_tokenizer(tokenizer)
    train, test = _splits(file, seq_len, stride, test_fraction, encoder)
    vocab = VOCAB_SIZE if encoder is None else encoder.vocab_size
    return DataBundle(name="text" if file is None else f"text:{file}", train=train, test=test,
                      input_shape=(seq_len,), num_classes=vocab, task="lm", default_model="transformer_lm",
                      vocab_size=vocab, seq_len=seq_len)
