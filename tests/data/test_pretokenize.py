"""Tokenizing documents into a token file: every token as the tokenizer gives it, the same bytes whatever the
number of processes, resumable, and one line for a JSON Lines line without the field."""

import json

import numpy as np
import pytest

from polytrain.data import documents, pretokenize
from polytrain.data.token_file import read_meta
from polytrain.data.tokenizer import load_tokenizer
from polytrain.errors import DataError

pytest.importorskip("tokenizers")

DOCS = [f"{word.upper()}, n. The {word} of a {i}th thing, said with {i % 5} words." for i, word in
        enumerate(["love", "war", "peace", "bore", "cynic", "egotist", "dog", "lawyer"] * 25)]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" + ("\n" if i % 7 == 0 else "")
                            for i, d in enumerate(DOCS)))
    return path


def expected(tok, texts):
    ids = []
    for text in texts:
        ids += tok.encode(text) + [tok.eos_id]
    return ids


def test_every_token_is_the_tokenizers_and_processes_do_not_change_the_file(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "CHUNK_BYTES", 2000)  # several chunks, some lines crossing their edges
    one = pretokenize.tokenize_files([str(corpus)], "text", tmp_path / "one.bin", workers=1)
    two = pretokenize.tokenize_files([str(corpus)], "text", tmp_path / "two.bin", workers=2)
    tok = load_tokenizer("text")
    tokens = np.fromfile(tmp_path / "one.bin", dtype=np.uint16)
    assert tokens.tolist() == expected(tok, DOCS)
    assert (tmp_path / "two.bin").read_bytes() == (tmp_path / "one.bin").read_bytes()
    assert one["documents"] == two["documents"] == len(DOCS) and one["tokens"] == len(tokens)
    assert read_meta(tmp_path / "one.bin")["tokenizer"]["fingerprint"] == tok.fingerprint
    assert not (tmp_path / "one.bin.parts").exists() and not (tmp_path / "two.bin.parts").exists()


def test_parquet_and_text_inputs(tmp_path):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"body": DOCS[:50], "n": list(range(50))}), tmp_path / "a.parquet", row_group_size=7)
    (tmp_path / "b.txt").write_text(DOCS[50])
    pretokenize.tokenize_files([str(tmp_path / "a.parquet"), str(tmp_path / "b.txt")], "text",
                               tmp_path / "out.bin", field="body", workers=1)
    tok = load_tokenizer("text")
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint16).tolist() == expected(tok, DOCS[:51])
    with pytest.raises(DataError, match=r"a.parquet has no column 'text' \(its columns: body, n\)"):
        pretokenize.tokenize_files([str(tmp_path / "a.parquet")], "text", tmp_path / "x.bin")


def test_an_interrupted_run_resumes_with_the_chunks_it_had_done(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(documents, "CHUNK_BYTES", 2000)
    done = []
    real = pretokenize.tokenize_chunk

    def stop_after_two(chunk, *args):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(chunk.start)
        return real(chunk, *args)

    monkeypatch.setattr(pretokenize, "tokenize_chunk", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        pretokenize.tokenize_files([str(corpus)], "text", tmp_path / "out.bin", workers=1)
    assert not (tmp_path / "out.bin").exists() and len(list((tmp_path / "out.bin.parts").glob("*.bin"))) == 2
    again = []
    monkeypatch.setattr(pretokenize, "tokenize_chunk", lambda chunk, *args: again.append(chunk.start) or real(chunk, *args))
    pretokenize.tokenize_files([str(corpus)], "text", tmp_path / "out.bin", workers=1)
    assert set(again).isdisjoint(done) and len(again) + 2 == len(documents.chunks([str(corpus)], "text", None, "t"))
    tok = load_tokenizer("text")
    assert np.fromfile(tmp_path / "out.bin", dtype=np.uint16).tolist() == expected(tok, DOCS)


def test_a_json_line_without_the_field_is_one_line_naming_it(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(DataError, match=r"docs.jsonl line 3 has no field 'text' \(it has: body\); name the "
                                        r"text's field with field=NAME") as err:
        pretokenize.tokenize_files([str(path)], "text", tmp_path / "out.bin")
    assert "\n" not in str(err.value)
    path.write_text(json.dumps({"body": "no text"}) + "\n")  # found on the first line, before any process starts
    with pytest.raises(DataError, match="line 1 has no field 'text'"):
        documents.chunks([str(path)], "text", None, "tokenize")


def test_a_vocabulary_too_large_for_uint16_and_damaged_metadata(tmp_path):
    from tokenizers import Tokenizer, models

    (tmp_path / "big").mkdir()
    vocab = {"</s>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    Tokenizer(models.WordLevel(vocab, unk_token="</s>")).save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w69999")
    with pytest.raises(Exception, match="--dtype uint16 cannot hold the ids of a vocabulary of 70000; use uint32"):
        pretokenize.tokenize_files([str(tmp_path / "a.txt")], str(tmp_path / "big"), tmp_path / "a.bin", dtype="uint16")
    (tmp_path / "t.bin").write_bytes(b"\x00\x01" * 20)
    (tmp_path / "t.bin.json").write_text("{not json")
    with pytest.raises(DataError, match=r"t.bin.json is not the JSON polytrain tokenize writes"):
        read_meta(tmp_path / "t.bin")
