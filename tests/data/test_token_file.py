"""``tokens:FILE.bin``: memory-mapped token files, uint16 and uint32, windows, packing, held-out data, metadata."""

import json

import numpy as np
import pytest
import torch

from polytrain.data import build_data, check_data
from polytrain.data.spans import Spans, TokenWindows
from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError, DataError


def write(path, tokens, dtype="uint16", meta=None):
    np.asarray(tokens, dtype=dtype).tofile(path)
    if meta is not None:
        path.with_name(path.name + ".json").write_text(json.dumps({"format": "polytrain-tokens", **meta}))
    return path


@pytest.mark.parametrize("dtype, top", [("uint16", 65_535), ("uint32", 1_000_000)])
def test_windows_of_either_width_are_read_from_the_mapped_file(tmp_path, dtype, top):
    tokens = np.arange(2000, dtype=np.int64) * 7 % top
    path = write(tmp_path / "train.bin", tokens, dtype)
    arg = "" if dtype == "uint16" else ",dtype=uint32"
    bundle = build_data(f"tokens:{path}{arg},seq_len=16")
    assert isinstance(bundle.train, TokenWindows) and isinstance(bundle.train.tokens, np.memmap)
    assert len(bundle.train) == (1800 - 17) // 16 + 1 and bundle.vocab_size == int(tokens.max()) + 1
    x, y = bundle.train.get_batch(torch.tensor([3]))
    assert x[0].tolist() == tokens[48:64].tolist() and y[0].tolist() == tokens[49:65].tolist()
    tx, _ = bundle.test.get_batch(torch.tensor([0]))
    assert tx[0].tolist() == tokens[1800:1816].tolist()  # the held-out tail, after every training token
    assert check_data(f"tokens:{path}{arg}", {"seq_len": 16}) == len(bundle.train)


def test_packed_documents_with_a_separate_validation_file(tmp_path):
    docs = [[5, 6, 7, 0], [8, 9, 0], [1, 2, 3, 4, 5, 0]] * 20
    meta = {"dtype": "uint16", "eos_id": 0, "vocab_size": 10, "max_id": 9}
    train = write(tmp_path / "train.bin", sum(docs, []), meta=meta)
    valid = write(tmp_path / "valid.bin", sum(docs[:6], []))
    bundle = build_data(f"tokens:{train},seq_len=8,test_file={valid}", pack=True)
    assert isinstance(bundle.train, Spans) and bundle.document_end == 0 and bundle.vocab_size == 10
    x, y = bundle.train.get_batch(torch.arange(len(bundle.train)))
    assert x[0].tolist() == [5, 6, 7, 0, 5, 6, 7, 0] and y[0].tolist()[3] == IGNORE_INDEX  # 4 + 4 tokens
    assert (y[x == 0] == IGNORE_INDEX).all() and int((y != IGNORE_INDEX).sum()) == 20 * (3 + 2 + 5)
    assert len(bundle.test) == 3 and bundle.train.efficiency() == 200 / (len(bundle.train) * 8)  # 6+3, 6+3, 4+4
    # unpacked, windows cross documents as in nanoGPT; windows=documents: each document its own sequence
    assert build_data(f"tokens:{train},seq_len=8").document_end is None
    one = build_data(f"tokens:{train},seq_len=8,windows=documents,test_file={valid}")
    assert len(one.train) == 60 and one.document_end is None
    assert one.train.get_batch(torch.tensor([1]))[1][0].tolist() == [9, 0]


def test_the_tokenizer_must_be_the_one_the_file_was_made_with(tmp_path):
    pytest.importorskip("tokenizers")
    path = write(tmp_path / "t.bin", list(range(300)),
                 meta={"dtype": "uint16", "tokenizer": {"source": "other", "fingerprint": "0123"}})
    with pytest.raises(ConfigError, match=r"--tokenizer text: tokens:.* was tokenized with another tokenizer \(other\)"):
        check_data(f"tokens:{path},seq_len=8", tokenizer="text")


@pytest.mark.parametrize("size, arg, message", [
    (1001, "", r"has 1001 bytes, not a whole number of uint16 tokens \(2 bytes each\)"),
    (1002, ",dtype=uint32", "not a whole number of uint32 tokens"),
    (0, "", "is empty"),
    (1000, ",dtype=int8", "dtype must be one of uint16, uint32"),
    (1000, ",windows=shuffled", "windows must be one of"),
    (20, ",seq_len=16", "too few for a window of seq_len 16"),
])
def test_bad_token_files_are_one_line(tmp_path, size, arg, message):
    path = tmp_path / "corpus.bin"
    path.write_bytes(b"\x01" * size)
    with pytest.raises(DataError, match=message) as err:
        check_data(f"tokens:{path}{arg}")
    assert "\n" not in str(err.value)


def test_packing_needs_to_know_the_end_of_document(tmp_path):
    path = write(tmp_path / "bare.bin", list(range(100)))
    with pytest.raises(ConfigError, match="--pack: tokens:.* does not say which token ends a document; give eos=ID"):
        check_data(f"tokens:{path},seq_len=8", pack=True)
    # one document of 96 tokens (95 targets: 12 pieces of up to 8) trains, the rest is held out
    assert check_data(f"tokens:{path},seq_len=8,eos=95", pack=True) == 12
    with pytest.raises(DataError, match="its test split holds no document"):  # 99 ends the only document
        check_data(f"tokens:{path},seq_len=8,eos=99", pack=True)


@pytest.mark.parametrize("spec, pack, message", [
    ("tokens", False, "tokens: name the file, e.g. --data tokens:train.bin"),
    ("tokens:{dir}/missing.bin", False, "tokens: no file .*missing.bin; give a token file"),
    ("tokens:{dir}/m.bin,dtype=uint32", False, r"holds uint16 tokens \(its m.bin.json says so\), not uint32"),
    ("tokens:{dir}/m.bin,stride=0", False, "tokens: stride must be an integer >= 1, got 0"),
    ("tokens:{dir}/m.bin,eos=-1", True, "eos must be a token id >= 0, got -1"),
    ("tokens:{dir}/m.bin,windows=random", True, "--pack lays whole documents into the sequences; leave windows=random out"),
    ("hf", False, "hf: name the data"),
])
def test_bad_arguments_are_one_line(tmp_path, spec, pack, message):
    write(tmp_path / "m.bin", list(range(1, 50)) * 4, meta={"dtype": "uint16"})
    with pytest.raises((DataError, ConfigError), match=message) as err:
        check_data(spec.format(dir=tmp_path), pack=pack)
    assert "\n" not in str(err.value)


def test_a_token_file_larger_than_the_memory_limit_trains_under_it(tmp_path):
    """The file is mapped read-only: its pages are the page cache's, never the worker's private memory."""
    import polytrain

    path = tmp_path / "big.bin"
    with open(path, "wb") as fh:  # 256 MiB of zeros that take no disk (a sparse file)
        fh.truncate(256 << 20)
    (tmp_path / "big.bin.json").write_text(json.dumps({"format": "polytrain-tokens", "dtype": "uint16",
                                                       "max_id": 0, "vocab_size": 16}))
    write(tmp_path / "valid.bin", [0] * 600)
    summary = polytrain.fit(model="transformer_lm:layers=1,dim=16,heads=2",
                            data=f"tokens:{path},seq_len=256,test_file={tmp_path / 'valid.bin'}", strategy="single",
                            memory_limit="64MiB", steps=3, batch_size=4, progress="off", eval_every=0)
    assert summary["steps"] == 3 and summary["train_loss"] is not None
