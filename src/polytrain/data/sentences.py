"""``sentences:FILE``: one sentence a line, each its own sequence of tokens (the PTB setting).

Sentence ``s`` becomes the tokens ``\\n s \\n``: input ``\\n s``, target ``s \\n`` (the input shifted by one),
so every byte of the sentence is predicted and so is its end; ``len(s) + 1`` real target tokens. The
newline doubles as begin- and end-of-sentence, which byte tokens have no other room for. Blank lines are
skipped. With ``--tokenizer`` a sentence is its tokenizer's ids and the tokenizer's end-of-document token
takes the newline's place. A batch is padded to its longest sentence (targets with IGNORE_INDEX, inputs with INPUT_PAD, see
:mod:`polytrain.data.tokens`); ``count_units`` reads the stored lengths, so the real-token count of any
set of examples (a whole global batch, say) costs one indexed sum and no communication.

The test split is ``test_file`` if given, else the last ``test_fraction`` of the sentences.
Example: ``sentences:ptb.train.txt,test_file=ptb.valid.txt``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Dataset

from polytrain.data.base import DataBundle
from polytrain.data.tokenizer import Tokenizer, cached_tokenizer
from polytrain.data.tokens import IGNORE_INDEX, INPUT_PAD, VOCAB_SIZE, check_fraction, read_utf8
from polytrain.errors import DataError

TEST_FRACTION = 0.1
NEWLINE = 10


class Sentences(Dataset):
    """Sentences of different lengths, stored as one token stream plus where each starts and its length.

    ``lines`` are byte strings (byte tokens, ``separator`` the newline) or lists of token ids (a tokenizer's,
    ``separator`` its end-of-document id); either way the stream is ``separator s0 separator s1 ...``."""

    def __init__(self, lines: Sequence[bytes] | Sequence[Sequence[int]], separator: int = NEWLINE):
        if not lines:
            raise ValueError("no sentences")
        # stream = sep s0 sep s1 sep ... : sentence i's window starts at its leading separator
        if isinstance(lines[0], bytes):
            sep = bytes([separator])
            self.stream = torch.frombuffer(bytearray(sep + sep.join(lines) + sep), dtype=torch.uint8)
        else:
            flat = [separator]
            for ids in lines:
                flat += ids
                flat.append(separator)
            self.stream = torch.tensor(flat, dtype=torch.int32)
        #: real target tokens of each sentence (its tokens and its end)
        self.lengths = torch.tensor([len(line) + 1 for line in lines], dtype=torch.int64)
        self.starts = torch.cumsum(self.lengths, 0) - self.lengths

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())

    @property
    def max_token_id(self) -> int:
        return int(self.stream.max())

    def get_batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (len(indices), longest length among them), padded at the end."""
        indices = indices.to(torch.int64)
        lengths = self.lengths[indices]
        steps = torch.arange(int(lengths.max()) if len(indices) else 0)
        real = steps < lengths.unsqueeze(1)
        # positions past a short sentence's end may run off the stream; they are masked below
        at = (self.starts[indices].unsqueeze(1) + steps).clamp_max_(len(self.stream) - 2)
        inputs = self.stream[at].to(torch.int64).masked_fill_(~real, INPUT_PAD)
        targets = self.stream[at + 1].to(torch.int64).masked_fill_(~real, IGNORE_INDEX)
        return inputs, targets

    def count_units(self, indices: torch.Tensor) -> int:
        return int(self.lengths[indices.to(torch.int64)].sum())

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


def read_sentences(path: str) -> list[bytes]:
    """The non-blank lines of a UTF-8 file, without their line endings."""
    lines = [line.rstrip(b"\r") for line in read_utf8(path, "sentences").split(b"\n")]
    kept = [line for line in lines if line.strip()]  # read_utf8 refused a file with no text at all
    return kept


def _sentences(lines: list[bytes], tokenizer: Tokenizer | None) -> Sentences:
    if tokenizer is None:
        return Sentences(lines)
    return Sentences(tokenizer.encode_batch([line.decode("utf-8") for line in lines]), tokenizer.require_eos())


def _splits(file: str, test_file: str | None, test_fraction: float, tokenizer: Tokenizer | None = None
            ) -> tuple[Sentences, Sentences]:
    lines = read_sentences(file)
    if test_file is not None:
        return _sentences(lines, tokenizer), _sentences(read_sentences(test_file), tokenizer)
    cut = int(len(lines) * (1 - check_fraction(test_fraction, "sentences")))
    if not 0 < cut < len(lines):
        raise DataError(f"sentences: {file} has {len(lines)} sentence(s), too few to keep {test_fraction} of "
                        "them for testing; add sentences or give test_file=FILE")
    return _sentences(lines[:cut], tokenizer), _sentences(lines[cut:], tokenizer)


def _file(file: str | None) -> str:
    if file is None:
        raise DataError("sentences: name the file, e.g. --data sentences:ptb.train.txt")
    return str(file)


def check_sentences(file: str | None = None, test_file: str | None = None,
                    test_fraction: float = TEST_FRACTION, bucket_window: int | None = None,
                    tokenizer: str | None = None) -> int:
    """Validate the file(s) (exist, not empty, UTF-8) and the window; the number of training sentences."""
    _check_window(bucket_window)
    return len(_splits(_file(file), test_file, test_fraction, cached_tokenizer(tokenizer))[0])


def sentences(file: str | None = None, test_file: str | None = None, test_fraction: float = TEST_FRACTION,
              bucket_window: int | None = None, tokenizer: str | None = None) -> DataBundle:
    """``bucket_window=W``: batches of sentences of similar length, sorted within windows of W global batches
    (:mod:`polytrain.data.buckets`: less padding; every sentence still once an epoch). Off by default.
    ``tokenizer`` (``--tokenizer``): each sentence its tokenizer's ids, ending with its end-of-document token."""
    _check_window(bucket_window)
    encoder = cached_tokenizer(tokenizer)
    train, test = _splits(_file(file), test_file, test_fraction, encoder)
    longest = max(train.max_len, test.max_len)
    vocab = VOCAB_SIZE if encoder is None else encoder.vocab_size
    return DataBundle(name=f"sentences:{file}", train=train, test=test, input_shape=(longest,),
                      num_classes=vocab, task="lm", default_model="rnn_lm", vocab_size=vocab,
                      seq_len=longest, bucket_window=bucket_window)


def _check_window(bucket_window: int | None) -> None:
    if bucket_window is not None and (isinstance(bucket_window, bool) or not isinstance(bucket_window, int)
                                      or bucket_window < 1):
        raise DataError(f"sentences: bucket_window must be a whole number of global batches >= 1, "
                        f"got {bucket_window!r}")
