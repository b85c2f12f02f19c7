"""Sequences cut from one stream of tokens: fixed windows, whole documents, and documents packed together.

The stream is a 1-D integer tensor, or a NumPy array (a memory-mapped token file: only the pages of the
sequences drawn are read). Every sequence is a span of ``n + 1 <= seq_len + 1`` tokens; its input is the first
``n`` and its target the last ``n`` (each position predicts the next token).

- :class:`TokenWindows`: a window every ``stride`` tokens, all of ``seq_len``; or, ``random=True``, windows
  at offsets drawn afresh each epoch from ``(seed, epoch, index)`` (nanoGPT's sampling, but the same on every
  rank and after a resume).
- :class:`Spans`: documents. The stream holds each document followed by its end-of-document token
  (``document_end``). An example is one document (a long one cut into pieces of ``seq_len + 1`` tokens, each
  piece's first token the previous piece's last), padded to the batch's longest; or, packed (:func:`pack`),
  whole documents laid together into sequences of ``seq_len`` by best fit, padded to ``seq_len``. A target
  that follows an end-of-document token (the next document's first token) is ignored, so the loss never
  crosses a document boundary; the model keeps attention within each document through the position ids
  :func:`document_positions` derives from the same tokens.
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
    """Example ``i``: the spans ``rows[i]:rows[i + 1]`` of ``(starts, ends)`` of the stream, joined (one span
    each where ``rows`` is None; see the module), padded to ``pad_to`` tokens (None: to the batch's longest);
    targets that follow ``document_end`` are ignored. Every span but a row's last ends a document."""

    def __init__(self, stream: torch.Tensor | np.ndarray, starts: torch.Tensor, ends: torch.Tensor,
                 document_end: int, rows: torch.Tensor | None = None, pad_to: int | None = None,
                 max_id: int | None = None):
        if len(starts) == 0:
            raise ValueError("no sequences")
        self.stream, self.document_end, self.pad_to = stream, document_end, pad_to
        self.starts, self.ends = starts.to(torch.int64), ends.to(torch.int64)
        self.rows = torch.arange(len(starts) + 1) if rows is None else rows.to(torch.int64)
        sizes = torch.zeros(len(self.rows) - 1, dtype=torch.int64).index_add_(
            0, torch.repeat_interleave(torch.arange(len(self.rows) - 1), self.rows.diff()), self.ends - self.starts)
        #: the input (and target) positions of each example
        self.lengths = sizes - 1
        #: real target tokens of each example: its positions less one for each document that ends inside it
        self.units = self.lengths - (self.rows.diff() - 1)
        self._max = max_id

    def __len__(self) -> int:
        return len(self.rows) - 1

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
        first, last = self.rows[indices], self.rows[indices + 1]
        spans = torch.repeat_interleave(first, last - first) + _ranks(last - first)  # this batch's spans
        sizes = self.ends[spans] - self.starts[spans]
        row = torch.repeat_interleave(torch.arange(len(indices)), last - first)
        within = torch.cumsum(sizes, 0) - sizes - torch.repeat_interleave(torch.cumsum(lengths + 1, 0) - lengths - 1,
                                                                          last - first)
        # each span's tokens at (its row, its place in the row)
        at_row = torch.repeat_interleave(row, sizes)
        at_col = torch.repeat_interleave(within, sizes) + _ranks(sizes)
        tokens = torch.full((len(indices), width + 1), INPUT_PAD, dtype=torch.int64)
        tokens[at_row, at_col] = gather(self.stream, torch.repeat_interleave(self.starts[spans], sizes) + _ranks(sizes))
        inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()
        pad = torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)
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


def _ranks(counts: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., c-1 for each count c, concatenated."""
    total = int(counts.sum())
    offsets = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return torch.arange(total) - offsets


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
    ends = torch.from_numpy(np.asarray(ends, dtype=np.int64))
    begins = torch.cat([torch.tensor([start]), ends[:-1]])
    keep = ends - begins >= 2
    begins, ends = begins[keep], ends[keep]
    pieces = (ends - begins - 1 + seq_len - 1) // seq_len  # ceil((len - 1) / seq_len) pieces of seq_len targets
    first = torch.repeat_interleave(begins, pieces) + seq_len * _ranks(pieces)
    return first, torch.minimum(first + seq_len + 1, torch.repeat_interleave(ends, pieces))


#: documents packed together at once (best fit among them): larger finds fuller sequences, slower
PACK_BLOCK = 8192


def pack(ends: np.ndarray, seq_len: int, start: int = 0, ended: bool = True
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(starts, ends, rows) of packed sequences: the documents (cut as :func:`documents` cuts them) laid into
    rows of at most ``seq_len + 1`` tokens by best fit decreasing, in blocks of :data:`PACK_BLOCK`: each piece,
    longest first, goes into the open row it fills most, or a new one. Rows are in the order their first
    piece came; row ``r`` holds the spans ``rows[r]:rows[r + 1]``. ``ended=False``: the stream's last
    document has no end-of-document token, so it gets rows of its own (a row's documents but its last must
    end with one)."""
    starts, stops = documents(ends, seq_len, start)
    alone = None
    if not ended and len(starts):  # its pieces (those beginning after the last true end) are not shared
        last_end = int(ends[-2]) if len(ends) > 1 else start
        alone = starts >= last_end
    order_starts, order_stops, bounds = [], [], [0]
    total = len(starts)
    for block in range(0, total, PACK_BLOCK):
        b_starts, b_stops = starts[block : block + PACK_BLOCK], stops[block : block + PACK_BLOCK]
        shared = torch.ones(len(b_starts), dtype=torch.bool) if alone is None else ~alone[block : block + PACK_BLOCK]
        rows = _best_fit((b_stops - b_starts)[shared].tolist(), seq_len + 1)
        index = torch.nonzero(shared).flatten()
        for row in rows:
            for item in row:
                order_starts.append(int(b_starts[index[item]]))
                order_stops.append(int(b_stops[index[item]]))
            bounds.append(len(order_starts))
        for item in torch.nonzero(~shared).flatten().tolist():
            order_starts.append(int(b_starts[item]))
            order_stops.append(int(b_stops[item]))
            bounds.append(len(order_starts))
    return (torch.tensor(order_starts, dtype=torch.int64), torch.tensor(order_stops, dtype=torch.int64),
            torch.tensor(bounds, dtype=torch.int64))


def _best_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Items (by index) in bins of ``capacity``: largest first, each into the bin it leaves least room in."""
    import bisect

    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        size = sizes[item]
        at = bisect.bisect_left(room, (size, -1))
        if at < len(room):
            left, row = room.pop(at)
            rows[row].append(item)
            if left - size > 1:  # (a row with room for one token more has nothing left to give)
                bisect.insort(room, (left - size, row))
        else:
            rows.append([item])
            if capacity - size > 1:
                bisect.insort(room, (capacity - size, len(rows) - 1))
    for row in rows:
        row.sort()  # a row's documents in their order in the stream
    return sorted(rows, key=lambda r: r[0])


def document_positions(inputs: torch.Tensor, document_end: int) -> torch.Tensor:
    """Position ids that restart at 0 after every end-of-document token of ``inputs`` (batch, time): what a
    model given ``position_ids=`` keeps attention within each document by (Hugging Face's packed format)."""
    time = inputs.shape[-1]
    steps = torch.arange(time, device=inputs.device).expand_as(inputs)
    begins = torch.zeros_like(inputs, dtype=torch.bool)
    begins[..., 1:] = inputs[..., :-1] == document_end
    first = torch.where(begins, steps, torch.zeros_like(steps)).cummax(dim=-1).values
    return steps - first
