import pytest
import torch

from polytrain.data import build_data, check_data
from polytrain.data.text import TokenWindows, shipped_text, text
from polytrain.errors import DataError


def test_shipped_text_is_the_devils_dictionary():
    data = shipped_text()
    assert 300_000 < len(data) < 500_000
    book = data.decode("ascii")  # ASCII, hence UTF-8: byte tokens are characters
    assert book.lstrip().startswith("PREFACE") and "ZOOLOGY, n." in book
    assert "00-database" not in book and "abcdefghijklmnopqrstuvwxyz" not in book  # dictd's entries are gone


def test_windows_are_shifted_by_one_and_cover_the_split_in_order():
    bundle = text(seq_len=32)
    assert bundle.task == "lm" and bundle.vocab_size == 256 == bundle.num_outputs and bundle.seq_len == 32
    assert bundle.input_shape == (32,) and bundle.default_model == "transformer_lm"
    data = shipped_text()
    cut = int(len(data) * 0.9)
    assert len(bundle.train) == (cut - 33) // 32 + 1 and len(bundle.test) == (len(data) - cut - 33) // 32 + 1
    x, y = bundle.train.get_batch(torch.tensor([0, 7]))
    assert x.shape == y.shape == (2, 32) and x.dtype == y.dtype == torch.int64
    assert bytes(x[1].tolist()) == data[7 * 32 : 8 * 32]
    assert bytes(y[1].tolist()) == data[7 * 32 + 1 : 8 * 32 + 1]
    tx, _ = bundle.test.get_batch(torch.tensor([0]))
    assert bytes(tx[0].tolist()) == data[cut : cut + 32]  # test windows come after every training byte


def test_stride_overlaps_windows_and_count_units_is_every_target():
    data = TokenWindows(torch.arange(100, dtype=torch.uint8), seq_len=10, stride=5)
    assert len(data) == (100 - 11) // 5 + 1
    x, _ = data.get_batch(torch.tensor([len(data) - 1]))
    assert x[0].tolist() == list(range(85, 95))
    assert data.count_units(torch.tensor([0, 3, 4])) == 30
    assert data.max_token_id == 99


def test_own_file_uses_the_same_tokens(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("héllo wörld, " * 40, encoding="utf-8")
    bundle = build_data(f"text:{path},seq_len=8")
    raw = path.read_bytes()
    x, y = bundle.train.get_batch(torch.tensor([1]))
    assert bytes(x[0].tolist()) == raw[8:16] and bytes(y[0].tolist()) == raw[9:17]
    assert bundle.name == f"text:{path}" and check_data(f"text:{path}", {"seq_len": 8}) == len(bundle.train)


@pytest.mark.parametrize("content, message", [
    (None, "no file"),
    (b"", "is empty"),
    (b"  \n\n", "is empty"),
    (b"caf\xe9 au lait" * 20, r"is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    (b"short", "too few for train and test windows"),
])
def test_bad_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    for attempt in (lambda: check_data(f"text:{path}"), lambda: build_data(f"text:{path}")):
        with pytest.raises(DataError, match=message) as err:
            attempt()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("args, message", [
    ({"seq_len": 0}, "seq_len must be an integer >= 1"),
    ({"stride": -2}, "stride must be an integer >= 1"),
    ({"test_fraction": 1.5}, "test_fraction must be a number between 0 and 1"),
])
def test_bad_arguments(args, message):
    with pytest.raises(DataError, match=message):
        check_data("text", args)

