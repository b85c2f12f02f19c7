import pytest
import torch

from polytrain.data import build_data, check_data
from polytrain.data.batches import BatchPlan, Slice, SlicedBatches
from polytrain.data.sentences import Sentences
from polytrain.data.tokens import IGNORE_INDEX, INPUT_PAD
from polytrain.errors import DataError

LINES = ["the cat sat", "a dog", "", "x", "on the mat, quietly\r", "né"]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "sentences.txt"
    path.write_bytes("\n".join(LINES * 5).encode("utf-8"))
    return path


def _real(lines):
    return [line.rstrip("\r").encode("utf-8") for line in lines if line]


def test_each_sentence_predicts_its_bytes_and_its_end_padded_per_batch():
    data = Sentences(_real(LINES))
    assert data.lengths.tolist() == [12, 6, 2, 20, 4]  # bytes + end; the blank line is not a sentence
    x, y = data.get_batch(torch.tensor([1, 2, 4]))
    assert x.shape == y.shape == (3, 6)  # padded to this batch's longest, not the dataset's
    assert bytes(x[0].tolist()) == b"\na dog" and bytes(y[0].tolist()) == b"a dog\n"
    assert x[1].tolist() == [10, ord("x")] + [INPUT_PAD] * 4
    assert y[1].tolist() == [ord("x"), 10] + [IGNORE_INDEX] * 4
    assert bytes(y[2, :4].tolist()).decode() == "né\n" and y[2, 4:].tolist() == [IGNORE_INDEX] * 2
    assert data.count_units(torch.tensor([1, 2, 4])) == int((y != IGNORE_INDEX).sum()) == 12
    assert x.min() >= 0  # a padding id is never an embedding index


def test_the_last_sentence_reads_to_the_stream_end():
    data = Sentences([b"ab", b"cdef"])
    x, y = data.get_batch(torch.tensor([1, 0]))
    assert bytes(y[0].tolist()) == b"cdef\n" and y[1].tolist() == [ord("a"), ord("b"), 10, -100, -100]


def test_bundle_splits_and_reports_the_longest_sentence(corpus, tmp_path):
    bundle = build_data(f"sentences:{corpus}")
    assert bundle.task == "lm" and bundle.default_model == "rnn_lm" and bundle.num_outputs == 256
    assert len(bundle.train) + len(bundle.test) == 25 and len(bundle.test) == 3
    assert bundle.seq_len == 20 == bundle.input_shape[0]
    other = tmp_path / "valid.txt"
    other.write_text("held out\n")
    split = build_data(f"sentences:{corpus},test_file={other}")
    assert len(split.train) == 25 and len(split.test) == 1
    assert check_data(f"sentences:{corpus}") == 22


def test_shards_of_a_global_batch_hold_uneven_tokens_and_add_up(corpus):
    data = build_data(f"sentences:{corpus}").train
    plan = BatchPlan(len(data), 8, seed=3)
    whole = plan.global_indices(5)
    slices = [Slice(i, 2).take(whole) for i in range(2)]
    units = [data.count_units(s) for s in slices]
    assert sum(units) == data.count_units(whole)
    per_worker = [next(iter(SlicedBatches(data, plan, Slice(i, 2), torch.device("cpu"), start_step=5)))
                  for i in range(2)]
    assert [int((y != IGNORE_INDEX).sum()) for _, _, y in per_worker] == units


def test_resumed_batches_equal_the_uninterrupted_ones(corpus):
    data = build_data(f"sentences:{corpus}").train
    plan = BatchPlan(len(data), 4, seed=7)

    def take(start, count):
        it = iter(SlicedBatches(data, plan, Slice(), torch.device("cpu"), start_step=start))
        return [next(it) for _ in range(count)]

    whole = take(0, 12)  # 5 steps per epoch: crosses two epoch boundaries
    resumed = take(7, 5)
    for (s1, x1, y1), (s2, x2, y2) in zip(whole[7:], resumed):
        assert s1 == s2 and torch.equal(x1, x2) and torch.equal(y1, y2)


@pytest.mark.parametrize("content, message", [
    (None, "no file"),
    (b"", "is empty"),
    (b"\n  \n\r\n", r"is empty \(or only blank lines\)"),
    (b"\xff\xfe sentence\n", "is not UTF-8 text"),
])
def test_bad_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "s.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        check_data(f"sentences:{path}")


def test_too_few_sentences_to_split(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("only one sentence\n")
    with pytest.raises(DataError, match="too few to keep 0.1 of them for testing"):
        build_data(f"sentences:{path}")


def test_a_file_is_required():
    with pytest.raises(DataError, match="name the file"):
        check_data("sentences")
