"""Where documents come from: JSON Lines byte ranges that share lines out exactly, and one line for every input
that cannot be read."""

import json

import pytest

from polytrain.data import documents
from polytrain.errors import ConfigError, DataError


def test_byte_ranges_hand_out_every_line_once(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    lines = [json.dumps({"text": "x" * (i % 13), "i": i}) for i in range(200)]
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(documents, "CHUNK_BYTES", 97)  # ranges that cut lines anywhere
    chunks = documents.chunks([str(path)], "text", None, "t")
    assert len(chunks) > 50
    read = [text for chunk in chunks for text in documents.read(chunk, "text", None, "t")]
    assert read == ["x" * (i % 13) for i in range(200)]


@pytest.mark.parametrize("write, field, message", [
    (lambda p: p.with_suffix(".jsonl").write_text('{"text": "a"}\nnot json\n'), "text",
     r"d.jsonl line 2 is not JSON \(.*\); give one JSON object a line"),
    (lambda p: p.with_suffix(".jsonl").write_text('{"text": 3}\n'), "text",
     r"d.jsonl line 1: field 'text' holds a int, not text"),
    (lambda p: p.with_suffix(".jsonl").write_text('[1, 2]\n'), "text",
     r"d.jsonl line 1 has no field 'text' \(it has: a list, not an object\)"),
    (lambda p: p.with_suffix(".jsonl").write_text(""), "text", r"d.jsonl is empty; give a file with documents"),
    (lambda p: p.with_suffix(".parquet").write_bytes(b"PAR1 no parquet"), "text", r"d.parquet is not a Parquet file"),
    (lambda p: None, "text", r"no file or directory .*d.jsonl"),
])
def test_unreadable_inputs_are_one_line(tmp_path, write, field, message):
    base = tmp_path / "d"
    write(base)
    target = next(tmp_path.glob("d.*"), base.with_suffix(".jsonl"))
    if target.suffix == ".parquet":
        pytest.importorskip("pyarrow")
    with pytest.raises(DataError, match=message) as err:
        for chunk in documents.chunks([str(target)], field, None, "tokenize"):
            documents.read(chunk, field, None, "tokenize")
    assert "\n" not in str(err.value) and str(err.value).startswith("tokenize: ")


def test_saved_datasets_name_what_is_wrong(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(DataError, match="is one dataset with no splits; leave split= out"):
        documents.chunks([str(tmp_path / "one")], "text", "validation", "hf")
    with pytest.raises(DataError, match=r"has no column 'body' \(its columns: text\); name the text's column"):
        documents.chunks([str(tmp_path / "one")], "body", None, "hf")
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="plain is not a dataset saved with datasets' save_to_disk"):
        documents.chunks([str(tmp_path / "plain")], "text", None, "hf")
    with pytest.raises(DataError, match="hf: no input"):
        documents.chunks([], "text", None, "hf")


def test_parquet_needs_pyarrow(tmp_path, monkeypatch):
    import sys

    (tmp_path / "d.parquet").write_bytes(b"x")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ConfigError, match=r"Parquet files need the pyarrow package: pip install 'polytrain\[datasets\]'"):
        documents.chunks([str(tmp_path / "d.parquet")], "text", None, "hf")
