"""Documents cut into sequences: one a sequence, or packed; targets never cross a document's end; position ids."""

import numpy as np
import torch

from polytrain.data.spans import Spans, TokenWindows, document_ends, document_positions, documents, pack
from polytrain.data.tokens import IGNORE_INDEX, INPUT_PAD

EOS = 9
# documents of 4, 3, 7, 2 and 3 tokens, each ending with EOS
STREAM = np.array([1, 2, 3, EOS, 4, 5, EOS, 1, 1, 2, 2, 3, 3, EOS, 6, EOS, 7, 8, EOS], dtype=np.uint16)


def test_document_ends_are_after_each_end_token():
    assert document_ends(STREAM, EOS).tolist() == [4, 7, 14, 16, 19]
    assert document_ends(STREAM[:-1], EOS).tolist() == [4, 7, 14, 16, 18]  # an unended last document


def test_one_document_a_sequence_cuts_long_ones_into_pieces_that_overlap_by_one():
    starts, ends = documents(document_ends(STREAM, EOS), seq_len=4)
    assert list(zip(starts.tolist(), ends.tolist())) == [(0, 4), (4, 7), (7, 12), (11, 14), (14, 16), (16, 19)]
    spans = Spans(STREAM, starts, ends, EOS)
    x, y = spans.get_batch(torch.tensor([2, 3, 4]))
    assert x.tolist() == [[1, 1, 2, 2], [3, 3, INPUT_PAD, INPUT_PAD], [6, INPUT_PAD, INPUT_PAD, INPUT_PAD]]
    assert y.tolist() == [[1, 2, 2, 3], [3, EOS, IGNORE_INDEX, IGNORE_INDEX], [EOS] + [IGNORE_INDEX] * 3]
    # every target of the stream once: each document's tokens after its first
    assert spans.units.sum() == sum(n - 1 for n in (4, 3, 7, 2, 3)) == spans.count_units(torch.arange(6))


def test_packing_fills_rows_by_best_fit_and_masks_the_crossing_targets():
    ends = document_ends(STREAM, EOS)
    starts, stops, rows = pack(ends, seq_len=8)
    row_spans = [list(zip(starts[rows[r]:rows[r + 1]].tolist(), stops[rows[r]:rows[r + 1]].tolist()))
                 for r in range(len(rows) - 1)]
    # 7 tokens + 2 fill 9; 4 + 3 + 3 = 10 do not: 4 + 3 and 3
    assert row_spans == [[(0, 4), (4, 7)], [(7, 14), (14, 16)], [(16, 19)]]
    spans = Spans(STREAM, starts, stops, EOS, rows, pad_to=8)
    x, y = spans.get_batch(torch.tensor([0, 1, 2]))
    assert x[0].tolist() == [1, 2, 3, EOS, 4, 5, INPUT_PAD, INPUT_PAD]
    assert y[0].tolist() == [2, 3, EOS, IGNORE_INDEX, 5, EOS, IGNORE_INDEX, IGNORE_INDEX]  # not EOS -> 4
    assert x[1].tolist() == [1, 1, 2, 2, 3, 3, EOS, 6] and y[1].tolist() == [1, 2, 2, 3, 3, EOS, IGNORE_INDEX, EOS]
    assert spans.units.tolist() == [int((row != IGNORE_INDEX).sum()) for row in y]
    assert spans.efficiency() == (3 + 2 + 6 + 1 + 2) / (3 * 8)
    # rows take documents from anywhere: a batch of rows in another order reads the same rows
    x2, y2 = spans.get_batch(torch.tensor([2, 0]))
    assert torch.equal(x2, x[[2, 0]]) and torch.equal(y2, y[[2, 0]])


def test_best_fit_beats_next_fit_and_long_documents_are_cut():
    lengths = [5, 9, 3, 7, 2, 8, 4, 6] * 4
    stream = np.concatenate([[1] * (n - 1) + [EOS] for n in lengths]).astype(np.uint16)
    starts, stops, rows = pack(document_ends(stream, EOS), seq_len=9)  # rows of 10 tokens
    spans = Spans(stream, starts, stops, EOS, rows, pad_to=9)
    assert len(spans) == 18 and spans.units.sum() == sum(n - 1 for n in lengths)  # 176 tokens in 18 rows of 10
    assert sorted(zip(starts.tolist(), stops.tolist())) == sorted(zip(*[t.tolist() for t in documents(
        document_ends(stream, EOS), 9)]))  # every document once
    long = np.array([1] * 20 + [EOS] + [2, EOS], dtype=np.uint16)
    starts, stops, rows = pack(document_ends(long, EOS), seq_len=8)
    assert list(zip(starts.tolist(), stops.tolist())) == [(0, 9), (8, 17), (16, 21), (21, 23)]
    assert rows.tolist() == [0, 1, 2, 4]  # the last piece of the long one shares a row


def test_an_unended_last_document_is_never_joined_by_another():
    stream = np.array([1, 2, EOS, 3, 4], dtype=np.uint16)
    starts, stops, rows = pack(document_ends(stream, EOS), seq_len=8, ended=False)
    assert rows.tolist() == [0, 1, 2]


def test_positions_restart_after_each_document_end():
    inputs = torch.tensor([[1, 2, EOS, 4, 5, EOS, 7], [EOS, 1, 2, 3, 4, 5, 6]])
    assert document_positions(inputs, EOS).tolist() == [[0, 1, 2, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4, 5]]


def test_random_windows_are_drawn_afresh_each_epoch_and_the_same_on_every_call():
    windows = TokenWindows(np.arange(1000, dtype=np.uint32), seq_len=10, stride=10, random=True, seed=3)
    first = windows.get_batch(torch.arange(8), epoch=0)[0]
    assert torch.equal(first, windows.get_batch(torch.arange(8), epoch=0)[0])
    assert not torch.equal(first, windows.get_batch(torch.arange(8), epoch=1)[0])
    assert torch.equal(first[:, 1:], first[:, :1] + torch.arange(1, 10))  # still contiguous windows
    assert int(windows.starts(torch.arange(100), 0).max()) <= 1000 - 11
