"""``hf:PATH,stream=true``: documents read and tokenized as training goes, split over the data-parallel ranks
without any rank reading all of them, with an exact position in every checkpoint.

The inputs (files, patterns such as ``shards/*.jsonl``, or a saved dataset) are cut into chunks
(:mod:`polytrain.data.documents`: JSON Lines byte ranges, Parquet row groups, ranges of rows), about eight a
*lane*. There are ``lanes`` lanes (``lanes=L``, by default the run's data-parallel ranks), and chunk ``i``
belongs to lane ``i mod L``. A lane reads its chunks in an order shuffled each epoch from (seed, epoch, lane),
tokenizes their documents (each followed by the end-of-document token) and cuts the tokens into rows of
``seq_len + 1`` (each row's last token the next row's first): a lane is a stream of windows, as a token file
is. A lane that reaches its last chunk starts its next epoch, so each epoch every lane reads each of its
chunks once, and the lanes together read every chunk once.

A global batch of ``B`` rows takes ``B / L`` rows of each lane, lane after lane; data-parallel rank ``r`` of
``W`` holds the slice of lanes ``r L / W .. (r + 1) L / W - 1``, and reads only their chunks. So ``W`` must
divide ``L`` and ``L`` divide ``B``; the batches do not depend on ``W``, and a run resumed on another number
of ranks trains on exactly the rows the uninterrupted run would have.

A checkpoint holds each lane's position (its epoch, the chunk, document and token its next row begins at):
``--resume`` re-reads that document and continues at that token. A row's id (what ``--log-example-ids``
records) is where its first token came from: ``chunk << 42 | document << 22 | token``.

A thread reads and tokenizes the next batches while the model computes (``tokenizers`` releases the
interpreter while it works), so a step waits for its data only when reading is slower than computing.
With ``--pack`` a target after an end-of-document token is ignored and position ids restart after it, as for
packed documents elsewhere (documents are cut across rows here, not packed whole); the real tokens of the
whole global batch are then summed over the ranks at each step, a small collective.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from polytrain.data import documents
from polytrain.data.documents import Chunk
from polytrain.data.tokenizer import cached_tokenizer
from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError, DataError

CHUNKS_PER_LANE = 8
_PREFETCH = 2  # batches read ahead
_TOKENIZE = 64  # documents tokenized at once
_SHUFFLE = 0x57EA  # separates a lane's chunk order from other uses of the seed


@dataclass
class TokenStream:
    """A streamed dataset (see the module): what to read and how; the lanes are made by :class:`StreamPlan`."""

    inputs: list[str]
    field: str
    split: str | None
    tokenizer: str
    seq_len: int
    pack: bool
    seed: int
    lanes: int | None = None  # lanes=L; None: the run's data-parallel ranks
    name: str = "stream"
    _chunks: dict[int, list[Chunk]] = field(default_factory=dict, repr=False)

    @property
    def eos(self) -> int:
        encoder = cached_tokenizer(self.tokenizer)
        assert encoder is not None
        return encoder.require_eos()

    def chunks(self, lanes: int) -> list[Chunk]:
        """The inputs' chunks for ``lanes`` lanes: about :data:`CHUNKS_PER_LANE` a lane."""
        if lanes not in self._chunks:
            what = f"hf:{','.join(self.inputs)}"
            whole = documents.chunks(self.inputs, self.field, self.split, what)
            total, rows = sum(c.size for c in whole), sum(c.stop - c.start for c in whole if c.kind == "saved")
            target = lanes * CHUNKS_PER_LANE
            self._chunks[lanes] = documents.chunks(
                self.inputs, self.field, self.split, what, groups=1,
                chunk_bytes=min(documents.CHUNK_BYTES, max(4096, total // target)),
                chunk_rows=min(documents.CHUNK_ROWS, max(1, rows // target)))
        return self._chunks[lanes]

    @property
    def max_token_id(self) -> int:
        """The largest id the tokenizer makes (the stream is not read to find the largest it holds)."""
        encoder = cached_tokenizer(self.tokenizer)
        assert encoder is not None
        return encoder.vocab_size - 1

    def describe(self) -> str:
        return (f"streamed, rows of {self.seq_len} tokens" + (" (documents masked apart)" if self.pack else "") +
                f", {self.lanes or 'one a data-parallel rank'} lanes")

    def check_lanes(self, lanes: int) -> None:
        count = len(self.chunks(lanes))
        if count < lanes:
            raise DataError(f"{self.name}: its {count} chunk(s) cannot feed {lanes} lanes (one a data-parallel "
                            "rank); give lanes=N with N at most that, or more data")


def row_id(chunk: int, doc: int, token: int) -> int:
    return chunk << 42 | doc << 22 | min(token, (1 << 22) - 1)


@dataclass
class LaneState:
    """Where a lane's next row begins: its epoch, the place in that epoch's chunk order, the document within
    the chunk and the token within the document."""

    epoch: int = 0
    place: int = 0
    doc: int = 0
    token: int = 0

    def as_list(self) -> list[int]:
        return [self.epoch, self.place, self.doc, self.token]


class Lane:
    """One lane's rows (see the module), from ``state`` on."""

    def __init__(self, stream: TokenStream, lane: int, lanes: int, state: LaneState | None = None):
        self.stream, self.lane = stream, lane
        every = stream.chunks(lanes)
        self.mine = [i for i in range(len(every)) if i % lanes == lane]
        self.every = every
        self.state = LaneState() if state is None else LaneState(*state.as_list())
        self.encoder = cached_tokenizer(stream.tokenizer)
        #: the last two chunks read, (epoch, place) -> (their documents, tokens of those tokenized so far): a row
        #: that crosses into the next chunk leaves the lane in either, and neither is read twice
        self._chunks: dict[tuple[int, int], tuple[list[str], dict[int, np.ndarray]]] = {}

    def order(self, epoch: int) -> list[int]:
        gen = torch.Generator().manual_seed((self.stream.seed * 1_000_003 + epoch) * 65_537 + self.lane + _SHUFFLE)
        return [self.mine[i] for i in torch.randperm(len(self.mine), generator=gen).tolist()]

    def _chunk(self, state: LaneState) -> tuple[list[str], dict[int, np.ndarray]]:
        key = (state.epoch, state.place)
        if key not in self._chunks:
            chunk = self.every[self.order(state.epoch)[state.place]]
            self._chunks[key] = (documents.read(chunk, self.stream.field, self.stream.split, self.stream.name), {})
            while len(self._chunks) > 2:
                del self._chunks[next(iter(self._chunks))]
        self._chunks[key] = self._chunks.pop(key)  # the most recently used last
        return self._chunks[key]

    def _documents(self, state: LaneState) -> list[str]:
        return self._chunk(state)[0]

    def _document(self, state: LaneState) -> np.ndarray:
        texts, tokens = self._chunk(state)
        if state.doc not in tokens:
            batch = range(state.doc, min(state.doc + _TOKENIZE, len(texts)))
            for i, ids in zip(batch, self.encoder.documents([texts[i] for i in batch])):
                tokens[i] = np.asarray(ids, dtype=np.int64)
            for old in [d for d in tokens if d < state.doc - 1]:
                del tokens[old]
        return tokens[state.doc]

    def _next_document(self, state: LaneState) -> None:
        state.doc, state.token = state.doc + 1, 0
        empty = 0  # chunks passed without a document: a whole round of them means the lane has none
        while state.doc >= len(self._documents(state)):
            empty += 1
            if empty > len(self.mine):
                raise DataError(f"{self.stream.name}: lane {self.lane} of its chunks holds no document; give fewer "
                                "lanes= or more data")
            state.doc, state.place = 0, state.place + 1
            if state.place >= len(self.mine):
                state.place, state.epoch = 0, state.epoch + 1

    def row(self) -> tuple[np.ndarray, int, int]:
        """The next row's ``seq_len + 1`` tokens, its id and its epoch; the lane moves on ``seq_len`` tokens."""
        state, need = self.state, self.stream.seq_len + 1
        if state.doc >= len(self._documents(state)) or state.token >= len(self._document(state)):
            self._next_document(state)
        start = LaneState(*state.as_list())
        ident = row_id(self.order(start.epoch)[start.place], start.doc, start.token)
        parts, walker, after = [], LaneState(*state.as_list()), None
        taken = 0
        while taken < need:
            tokens = self._document(walker)[walker.token :]
            use = tokens[: need - taken]
            if after is None and taken + len(use) > need - 1:  # the row's last token: the next row's first
                after = LaneState(walker.epoch, walker.place, walker.doc, walker.token + (need - 1 - taken))
            parts.append(use)
            taken += len(use)
            walker.token += len(use)
            if taken < need:
                self._next_document(walker)
        assert after is not None
        self.state = after
        return np.concatenate(parts), ident, start.epoch


@dataclass(frozen=True)
class StreamPlan:
    """What stands for a :class:`~polytrain.data.batches.BatchPlan` with a stream: the global batch, the lanes,
    where they start, and the epochs every lane has finished (for the step records)."""

    global_batch: int
    lanes: int
    start: tuple[LaneState, ...]
    stream: TokenStream = field(repr=False, compare=False)
    resumed: Any = None
    steps_per_epoch: None = None

    @classmethod
    def make(cls, stream: TokenStream, global_batch: int, dp: int, saved: dict[str, Any] | None = None) -> StreamPlan:
        lanes = int(saved["lanes"]) if saved else (stream.lanes or dp)
        if saved and stream.lanes not in (None, lanes):
            raise ConfigError(f"--resume: the checkpoint's stream has {lanes} lanes, not lanes={stream.lanes}; "
                              "leave lanes= as it was")
        if lanes % dp:
            raise ConfigError(f"{stream.name}: {dp} data-parallel ranks cannot share {lanes} lanes; use a number of "
                              f"ranks that divides {lanes}" + (" (the checkpoint's lanes)" if saved else
                                                                 ", or lanes=N with N a multiple of the ranks"))
        if global_batch % lanes:
            raise ConfigError(f"--batch-size {global_batch}: a stream's global batch takes as many rows of each of "
                              f"its {lanes} lanes; use a multiple of {lanes}")
        stream.check_lanes(lanes)
        start = tuple(LaneState(*s) for s in saved["states"]) if saved else tuple(LaneState() for _ in range(lanes))
        return cls(global_batch, lanes, start, stream)

    def position(self, step: int) -> tuple[int, int]:
        return min(s.epoch for s in self.start), step

    def epochs_done(self, step: int) -> float:
        return float(min(s.epoch for s in self.start))

    def epoch_start(self, epoch: int) -> int:
        raise ConfigError(f"{self.stream.name}: a stream's length is not known before it is read; give --steps N "
                          "rather than --epochs")

    def checkpoint_position(self, gathered: list[dict[int, list[int]] | None]) -> dict[str, Any]:
        """The data position of a checkpoint from every trainer's lanes (ranks of one slice agree)."""
        states: dict[int, list[int]] = {}
        for mine in gathered:
            states.update(mine or {})
        return {"stream": True, "lanes": self.lanes, "global_batch": self.global_batch,
                "states": [states[lane] for lane in range(self.lanes)]}


class StreamBatches:
    """This rank's batches of ``plan`` (its slice ``index`` of ``count``), read ahead by a thread; the
    position after the last batch handed out is :meth:`position`."""

    def __init__(self, plan: StreamPlan, index: int, count: int, device: torch.device, start_step: int,
                 trainers: Any = None):
        per = plan.lanes // count
        self.mine = list(range(index * per, (index + 1) * per))
        self.plan, self.device, self.step, self.trainers, self.index = plan, device, start_step, trainers, index
        self.rows = plan.global_batch // plan.lanes
        self.lanes = [Lane(plan.stream, lane, plan.lanes, plan.start[lane]) for lane in self.mine]
        self.eos = plan.stream.eos
        self._position = {lane: plan.start[lane].as_list() for lane in self.mine}
        self._queue: queue.Queue = queue.Queue(_PREFETCH)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="polytrain-stream", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                rows, ids, epochs = [], [], []
                for lane in self.lanes:
                    for _ in range(self.rows):
                        tokens, ident, epoch = lane.row()
                        rows.append(tokens)
                        ids.append(ident)
                        epochs.append(epoch)
                after = {lane: self.lanes[i].state.as_list() for i, lane in enumerate(self.mine)}
                item = (torch.from_numpy(np.stack(rows)), torch.tensor(ids, dtype=torch.int64), min(epochs), after)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            self._queue.put(exc)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        from polytrain.data.batches import Batch

        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        tokens, ids, epoch, after = item
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].clone()
        if self.plan.stream.pack:
            targets.masked_fill_(inputs == self.eos, IGNORE_INDEX)
            units = self._global_units(int((targets != IGNORE_INDEX).sum()))
        else:
            units = self.plan.global_batch * self.plan.stream.seq_len
        self._position = after
        batch = Batch(self.step, inputs.to(self.device), targets.to(self.device), units, self.plan.global_batch, ids,
                      epoch=epoch)
        self.step += 1
        return batch

    def _global_units(self, mine: int) -> int:
        """The real tokens of the whole global batch: each slice's counted once (ranks of one slice agree)."""
        if self.trainers is None:
            return mine
        counts = dict(self.trainers.all_gather_object((self.index, mine)))
        return sum(counts.values())

    def position(self) -> dict[int, list[int]]:
        """Each of this rank's lanes' position after the last batch handed out."""
        return dict(self._position)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
