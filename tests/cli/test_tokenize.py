"""``polytrain tokenize`` from the command line: a token file that ``--data tokens:`` trains on, the same ids as
``--data text:FILE --tokenizer T``, and one line for what it cannot do."""

import numpy as np
import pytest
import torch

from polytrain.cli.main import main
from polytrain.data import build_data

pytest.importorskip("tokenizers")


def test_a_text_file_becomes_the_tokens_text_data_reads_plus_the_end(tmp_path, capsys):
    corpus = tmp_path / "book.txt"
    corpus.write_text("CYNIC, n. A blackguard whose faulty vision sees things as they are.\n" * 40)
    assert main(["tokenize", str(corpus), "--tokenizer", "text", "--output", str(tmp_path / "book.bin"),
                 "--progress", "off"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"wrote {tmp_path / 'book.bin'}: ") and "1 documents, vocabulary 1,024" in out
    tokens = np.fromfile(tmp_path / "book.bin", dtype=np.uint16).tolist()
    text = build_data(f"text:{corpus},seq_len=8", tokenizer="text")
    assert tokens == torch.cat([text.train.tokens, text.test.tokens]).tolist() + [0]
    trained = build_data(f"tokens:{tmp_path / 'book.bin'},seq_len=8", tokenizer="text")
    assert trained.vocab_size == 1024 and len(trained.train) > 0


def test_it_will_not_overwrite_a_file(tmp_path, capsys):
    corpus = tmp_path / "a.txt"
    corpus.write_text("some text")
    (tmp_path / "a.bin").write_bytes(b"precious")
    code = main(["tokenize", str(corpus), "--tokenizer", "text", "-o", str(tmp_path / "a.bin")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "a.bin exists; remove it or give another --output" in err
    assert (tmp_path / "a.bin").read_bytes() == b"precious"


def test_workers_must_be_at_least_one(tmp_path, capsys):
    assert main(["tokenize", "x.txt", "--tokenizer", "text", "-o", str(tmp_path / "o.bin"), "--workers", "0"]) == 2
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err
