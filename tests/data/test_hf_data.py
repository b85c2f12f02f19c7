"""``hf:PATH``: JSON Lines, Parquet and saved datasets, tokenized once into a cache beside them keyed by the
tokenizer and the settings; one document a sequence, or packed."""

import json
import sys

import numpy as np
import pytest
import torch

from polytrain.data import build_data, check_data
from polytrain.data.hf_data import CACHE
from polytrain.data.tokenizer import load_tokenizer
from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError

pytest.importorskip("tokenizers")

DOCS = [f"Document {i}: " + "the quick brown fox " * (i % 6 + 1) for i in range(120)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "data" / "train.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


def test_documents_are_tokenized_once_into_a_cache_beside_the_data(jsonl):
    bundle = build_data(f"hf:{jsonl},seq_len=64,test_fraction=0.2", tokenizer="text")
    cached = list((jsonl.parent / CACHE).glob("train.jsonl-*.bin"))
    assert len(cached) == 1 and bundle.document_end is None
    tok = load_tokenizer("text")
    x, y = bundle.train.get_batch(torch.tensor([0, 1]))
    first = tok.encode(DOCS[0]) + [tok.eos_id]
    assert x[0, : len(first) - 1].tolist() == first[:-1] and y[0, : len(first) - 1].tolist() == first[1:]
    assert (y[0, len(first) - 1 :] == IGNORE_INDEX).all()  # padded to the batch's longest document
    assert len(bundle.train) + len(bundle.test) == len(DOCS)  # every document shorter than 64 tokens
    stamp = cached[0].stat().st_mtime_ns
    build_data(f"hf:{jsonl},seq_len=16", tokenizer="text", pack=True)  # other settings, the same tokens
    assert cached[0].stat().st_mtime_ns == stamp and len(list((jsonl.parent / CACHE).glob("*.bin"))) == 1
    jsonl.write_text(jsonl.read_text() + json.dumps({"text": "one more"}) + "\n")  # changed data: tokenized anew
    assert check_data(f"hf:{jsonl}", tokenizer="text") > 0
    assert len(list((jsonl.parent / CACHE).glob("*.bin"))) == 2


def test_packed_documents_fill_their_sequences(jsonl):
    one = build_data(f"hf:{jsonl},seq_len=64", tokenizer="text")
    packed = build_data(f"hf:{jsonl},seq_len=64", tokenizer="text", pack=True)
    assert packed.document_end == 0 and len(packed.train) < 0.6 * len(one.train)
    assert packed.train.count_units(torch.arange(len(packed.train))) == one.train.count_units(torch.arange(len(one.train)))
    # documents of 10 to 53 tokens: alone, padded to the longest, they fill 64 % of the positions; packed 90 %
    assert one.train.efficiency() < 0.65 and packed.train.efficiency() > 0.85
    assert "documents packed" in packed.describe()


def test_a_saved_dataset_and_its_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"content": DOCS[:80]}),
                          "validation": datasets.Dataset.from_dict({"content": DOCS[80:]})}).save_to_disk(str(saved))
    train = build_data(f"hf:{saved},field=content,seq_len=64,test_fraction=0.5", tokenizer="text")
    valid = build_data(f"hf:{saved},field=content,split=validation,seq_len=64,test_fraction=0.5", tokenizer="text")
    tok = load_tokenizer("text")
    assert train.train.get_batch(torch.tensor([0]))[0][0, :3].tolist() == tok.encode(DOCS[0])[:3]
    assert valid.train.get_batch(torch.tensor([0]))[0][0, :3].tolist() == tok.encode(DOCS[80])[:3]
    assert len(train.train) + len(train.test) == 80 and len(valid.train) + len(valid.test) == 40
    with pytest.raises(Exception, match="has no split 'test'; its splits: train, validation"):
        check_data(f"hf:{saved},field=content,split=test", tokenizer="text")


def test_a_parquet_file(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "d.parquet", row_group_size=50)
    bundle = build_data(f"hf:{tmp_path / 'd.parquet'},seq_len=32", tokenizer="text", pack=True)
    tokens = np.fromfile(next((tmp_path / CACHE).glob("d.parquet-*.bin")), dtype=np.uint16)
    assert int((tokens == 0).sum()) == len(DOCS) and bundle.vocab_size == 1024


def test_hf_data_needs_a_tokenizer_and_datasets_for_a_saved_dataset(jsonl, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"hf:.*train.jsonl: the documents are text: give --tokenizer"):
        check_data(f"hf:{jsonl}")
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"a saved Hugging Face dataset needs the datasets package: pip install "
                                          r"'polytrain\[datasets\]'") as err:
        check_data(f"hf:{tmp_path / 'saved'}", tokenizer="text")
    assert "\n" not in str(err.value)
