"""Sequences cut from one stream of tokens: fixed windows, whole documents, and documents packed together.

The stream is a 1-D integer tensor, or a NumPy array (a memory-mapped token file: only the pages of the
sequences drawn are read). Every sequence is a span of ``n + 1 <= seq_len + 1`` tokens; its input is the first
``n`` and its target the last ``n`` (each position predicts the next token).

- :class:`TokenWindows`: a window every ``stride`` tokens, all of ``seq_len``; or, ``random=True``, windows
  at offsets drawn afresh each epoch from ``(seed, epoch, index)`` (nanoGPT's sampling, but the same on every
  rank and after a resume).
- :class:`Spans`: spans given by their starts and ends. For documents, the stream holds each document
  followed by its end-of-document token (``document_end``), and a span is either one document (a long one
  cut into pieces of ``seq_len + 1`` tokens, each piece's first token the previous piece's last), padded to
  the batch's longest, or, packed (:func:`pack`), as many whole documents as fit in ``seq_len + 1`` tokens,
  padded to ``seq_len``. A target that follows an end-of-document token (the next document's first token) is
  ignored, so the loss never crosses a document boundary; the model keeps attention within each document
  through the position ids :func:`document_positions` derives from the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from polytrain.data.base import example_uniform
from polytrain.data.tokens import IGNORE_INDEX, INPUT_PAD

_RANDOM_STREAM = 0x3A7D  # separates random window offsets from other per-example draws of the same seed


def gather(stream: torch.Tensor | np.ndarray, at: torch.Tensor) -> torch.Tensor:
    """``stream[at]`` as int64, for a tensor or a (memory-mapped) NumPy array."""
    if isinstance(stream, torch.Tensor):
        return stream[at].to(torch.int64)
    return torch.from_numpy(np.asarray(stream[at.numpy()], dtype=np.int64))


def max_token(stream: torch.Tensor | np.ndarray, chunk: int = 1 << 24) -> int:
    """The largest id in ``stream``, read in chunks (a memory-mapped file is never loaded whole)."""
    if isinstance(stream, torch.Tensor):
        return int(stream.max())
    return max(int(stream[i : i + chunk].max()) for i in range(0, len(stream), chunk))


class TokenWindows(Dataset):
    """Windows of ``seq_len + 1`` tokens every ``stride`` tokens of ``tokens``; ``random=True``: as many
    windows, at offsets drawn from ``(seed, epoch, index)``."""

    def __init__(self, tokens: torch.Tensor | np.ndarray, seq_len: int, stride: int, *, random: bool = False,
                 seed: int = 0):
        if len(tokens) < seq_len + 1:
            raise ValueError(f"{len(tokens)} tokens hold no window of seq_len {seq_len} + 1")
        self.tokens, self.seq_len, self.stride, self.random, self.seed = tokens, seq_len, stride, random, seed
        self._offsets = torch.arange(seq_len + 1)
        self._count = (len(tokens) - seq_len - 1) // stride + 1
        self._max: int | None = None

    def __len__(self) -> int:
        return self._count

    @property
    def max_token_id(self) -> int:
        if self._max is None:
            self._max = max_token(self.tokens)
        return self._max

    def starts(self, indices: torch.Tensor, epoch: int = 0) -> torch.Tensor:
        indices = indices.to(torch.int64)
        if not self.random:
            return indices * self.stride
        last = len(self.tokens) - self.seq_len - 1  # the last offset a window may start at
        draw = example_uniform(self.seed, epoch, indices, _RANDOM_STREAM)[:, 0].to(torch.float64)
        return (draw * (last + 1)).to(torch.int64).clamp_(max=last)

    def get_batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both int64 of shape (len(indices), seq_len); targets = inputs shifted by one."""
        windows = gather(self.tokens, self.starts(indices, epoch).unsqueeze(1) + self._offsets)
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    def count_units(self, indices: torch.Tensor) -> int:
        """Real target tokens of these examples: every window holds ``seq_len``."""
        return len(indices) * self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


class Spans(Dataset):
    """Example ``i``: the tokens ``stream[starts[i]:ends[i]]`` (see the module), padded to ``pad_to`` tokens
    (None: to the batch's longest); targets that follow ``document_end`` are ignored."""

    def __init__(self, stream: torch.Tensor | np.ndarray, starts: torch.Tensor, ends: torch.Tensor,
                 document_end: int, doc_ends: np.ndarray, pad_to: int | None = None, max_id: int | None = None):
        if len(starts) == 0:
            raise ValueError("no sequences")
        self.stream, self.document_end, self.pad_to = stream, document_end, pad_to
        self.starts, self.ends = starts.to(torch.int64), ends.to(torch.int64)
        #: the input (and target) positions of each example
        self.lengths = self.ends - self.starts - 1
        #: real target tokens of each example: its positions less those whose input ends a document (the end
        #: of a document at e is an input of the span [s, t) when s < e < t)
        inside = np.searchsorted(doc_ends, self.ends.numpy() - 1, side="right") - np.searchsorted(
            doc_ends, self.starts.numpy(), side="right")
        self.units = self.lengths - torch.from_numpy(inside.astype(np.int64))
        self._max = max_id

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def max_len(self) -> int:
        return int(self.lengths.max())

    @property
    def max_token_id(self) -> int:
        if self._max is None:
            self._max = max_token(self.stream)
        return self._max

    def get_batch(self, indices: torch.Tensor, epoch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        indices = indices.to(torch.int64)
        lengths = self.lengths[indices]
        width = self.pad_to if self.pad_to is not None else (int(lengths.max()) if len(indices) else 0)
        steps = torch.arange(width + 1)
        real = steps < lengths.unsqueeze(1) + 1  # the span's tokens, its last one a target only
        at = (self.starts[indices].unsqueeze(1) + steps).clamp_max_(len(self.stream) - 1)
        tokens = gather(self.stream, at)
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        pad = ~real[:, 1:]
        inputs.masked_fill_(pad, INPUT_PAD)
        targets.masked_fill_(pad | (inputs == self.document_end), IGNORE_INDEX)
        return inputs, targets

    def count_units(self, indices: torch.Tensor) -> int:
        return int(self.units[indices.to(torch.int64)].sum())

    def efficiency(self) -> float:
        """Real target tokens per token position computed, with every sequence ``pad_to`` long."""
        width = self.pad_to if self.pad_to is not None else self.max_len
        return float(self.units.sum()) / (len(self) * width)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.get_batch(torch.tensor([index]))
        return x[0], y[0]


def document_ends(stream: torch.Tensor | np.ndarray, document_end: int, chunk: int = 1 << 24) -> np.ndarray:
    """Where each document ends: the index after each end-of-document token (and the stream's end, if the
    stream does not end with one), read in chunks."""
    found = [np.flatnonzero(np.asarray(stream[i : i + chunk]) == document_end) + i + 1
             for i in range(0, len(stream), chunk)]
    ends = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
    if len(ends) == 0 or ends[-1] != len(stream):
        ends = np.append(ends, len(stream))
    return ends.astype(np.int64)


def documents(ends: np.ndarray, seq_len: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) of each document that begins at ``start`` and ends at each of ``ends``, a long one cut
    into pieces of at most ``seq_len + 1`` tokens (each piece beginning at the previous piece's last token);
    documents of a single token (nothing to predict) are left out."""
    begins = np.concatenate([[start], ends[:-1]])
    lengths = ends - begins
    pieces = np.maximum(1, -(-(lengths - 1) // seq_len))  # ceil((len - 1) / seq_len) pieces of seq_len targets
    keep = lengths >= 2
    begins, ends, pieces = begins[keep], ends[keep], pieces[keep]
    first = np.repeat(begins, pieces) + seq_len * _ranks(pieces)
    last = np.minimum(first + seq_len + 1, np.repeat(ends, pieces))
    return torch.from_numpy(first.astype(np.int64)), torch.from_numpy(last.astype(np.int64))


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0, 1, ..., c-1 for each count c, concatenated."""
    total = int(counts.sum())
    offsets = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total) - offsets


def pack(ends: np.ndarray, seq_len: int, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, ends) of packed sequences: whole documents, in order, as many as fit in ``seq_len + 1``
    tokens (next fit: a document that does not fit starts the next sequence; one longer than a sequence is
    cut into pieces as :func:`documents` cuts it)."""
    firsts, lasts = [], []
    s, limit, i, count = start, seq_len + 1, 0, len(ends)
    while i < count:
        # the last document end within reach of this sequence
        j = int(np.searchsorted(ends, s + limit, side="right")) - 1
        if j >= i:
            firsts.append(s)
            lasts.append(int(ends[j]))
            s, i = int(ends[j]), j + 1
        else:  # document i is longer than a sequence: a full piece of it, the rest continues
            firsts.append(s)
            lasts.append(s + limit)
            s += seq_len
            if ends[i] - s < 2:  # (only its last token left, already a target)
                s, i = int(ends[i]), i + 1
    return torch.tensor(firsts, dtype=torch.int64), torch.tensor(lasts, dtype=torch.int64)


def document_positions(inputs: torch.Tensor, document_end: int) -> torch.Tensor:
    """Position ids that restart at 0 after every end-of-document token of ``inputs`` (batch, time): what a
    model given ``position_ids=`` keeps attention within each document by (Hugging Face's packed format)."""
    time = inputs.shape[-1]
    steps = torch.arange(time, device=inputs.device).expand_as(inputs)
    begins = torch.zeros_like(inputs, dtype=torch.bool)
    begins[..., 1:] = inputs[..., :-1] == document_end
    first = torch.where(begins, steps, torch.zeros_like(steps)).cummax(dim=-1).values
    return steps - first
