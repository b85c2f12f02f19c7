"""``--tokenizer``: the shipped one, a Hugging Face tokenizer.json or model directory, a SentencePiece model, and
language-model text tokenized with it exactly as the tokenizer itself does."""

import json

import pytest
import torch

from polytrain.data import build_data, check_data
from polytrain.data.tokenizer import load_tokenizer
from polytrain.errors import ConfigError

tokenizers = pytest.importorskip("tokenizers")

TEXT = "The cat sat on the mat.\nA dog, quietly, ate the cat's dinner.\n" * 30


def word_tokenizer(directory, eos="</s>"):
    """A tiny WordLevel tokenizer saved as a Hugging Face model directory would hold it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", eos]))
    directory.mkdir(exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    return tok


def test_the_shipped_tokenizer_is_a_byte_level_bpe_of_the_shipped_text():
    tok = load_tokenizer("text")
    assert tok.vocab_size == 1024 and tok.eos_id == 0 and tok.decode([0]) == "<|endoftext|>"
    sample = "WAR, n. A by-product of the arts of peace. Ünïcödé too"
    assert tok.decode(tok.encode(sample)) == sample  # byte level: nothing is unknown
    assert len(tok.encode("LOVE, n. A temporary insanity")) < len("LOVE, n. A temporary insanity") * 0.6
    assert tok.documents(["a", "b c"]) == [tok.encode("a") + [0], tok.encode("b c") + [0]]


def test_a_model_directory_names_its_end_of_document_token(tmp_path):
    hf = word_tokenizer(tmp_path / "model")
    tok = load_tokenizer(str(tmp_path / "model"))
    assert tok.eos_id == hf.token_to_id("</s>") and tok.vocab_size == hf.get_vocab_size()
    assert tok.encode("the cat sat") == hf.encode("the cat sat", add_special_tokens=False).ids
    assert load_tokenizer(str(tmp_path / "model" / "tokenizer.json")).fingerprint == tok.fingerprint


def test_text_and_sentences_take_the_tokenizers_ids(tmp_path):
    hf = word_tokenizer(tmp_path / "model")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    bundle = build_data(f"text:{corpus},seq_len=8", tokenizer=str(tmp_path / "model"))
    ids = hf.encode(TEXT, add_special_tokens=False).ids  # the whole text at once, as the tokenizer does it
    stream = torch.cat([bundle.train.tokens, bundle.test.tokens]).tolist()
    assert stream == ids and bundle.vocab_size == hf.get_vocab_size() == bundle.num_outputs
    x, y = bundle.train.get_batch(torch.tensor([2]))
    assert x[0].tolist() == ids[16:24] and y[0].tolist() == ids[17:25]
    assert check_data(f"text:{corpus},seq_len=8", tokenizer=str(tmp_path / "model")) == len(bundle.train)

    sentences = build_data(f"sentences:{corpus}", tokenizer=str(tmp_path / "model"))
    eos = hf.token_to_id("</s>")
    x, y = sentences.train.get_batch(torch.tensor([1]))
    line = hf.encode("A dog, quietly, ate the cat's dinner.", add_special_tokens=False).ids
    assert x[0].tolist() == [eos] + line and y[0].tolist() == line + [eos]


def test_sentencepiece_models_are_read_too(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    tok = load_tokenizer(str(tmp_path / "sp.model"))
    reference = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.encode("the cat sat") == reference.encode("the cat sat") and tok.eos_id == reference.eos_id()
    assert tok.decode(tok.encode("the cat sat")) == "the cat sat"


@pytest.mark.parametrize("content, message", [
    (b'{"not": "a tokenizer"}', "not a tokenizers tokenizer.json"),
    (b"\x00\xff\xfe binary", "not a tokenizer.json"),
    (None, "no such file or directory"),
])
def test_a_tokenizer_file_that_is_not_one_is_one_line(tmp_path, content, message):
    path = tmp_path / "tokenizer.json"
    if content is not None:
        path.write_bytes(content)
    for attempt in (lambda: load_tokenizer(str(path)), lambda: check_data("text", tokenizer=str(path))):
        with pytest.raises(ConfigError, match=message) as err:
            attempt()
        assert "\n" not in str(err.value) and str(err.value).startswith(f"--tokenizer {path}")


def test_data_without_text_refuses_a_tokenizer():
    with pytest.raises(ConfigError, match="--tokenizer: --data digits has no text to tokenize"):
        check_data("digits", tokenizer="text")


def test_tokenizers_without_an_end_or_a_file_are_one_line(tmp_path):
    from tokenizers import Tokenizer, models

    (tmp_path / "bare").mkdir()
    Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a")).save(str(tmp_path / "bare" / "tokenizer.json"))
    tok = load_tokenizer(str(tmp_path / "bare"))
    with pytest.raises(ConfigError, match="it has no end-of-document token"):
        tok.require_eos()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the directory holds no tokenizer.json nor tokenizer.model"):
        load_tokenizer(str(tmp_path / "empty"))
    (tmp_path / "x.model").write_bytes(b"not a model")
    pytest.importorskip("sentencepiece")
    with pytest.raises(ConfigError, match="not a SentencePiece model"):
        load_tokenizer(str(tmp_path / "x.model"))


def test_missing_packages_and_a_setting_given_twice_are_one_line(monkeypatch):
    import sys

    with pytest.raises(ConfigError, match="--data: tokenizer given both as --tokenizer and in 'text:tokenizer=text'"):
        check_data("text:tokenizer=text", tokenizer="text")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if it were not installed
    with pytest.raises(ConfigError, match=r"--tokenizer needs the tokenizers package: pip install "
                                          r"'polytrain\[tokenizers\]' \(or leave --tokenizer out: bytes are the tokens\)"):
        load_tokenizer("text")


def test_a_hugging_face_models_own_tokenizer_is_the_runs_by_default(tmp_path):
    from polytrain.api import make_config
    from polytrain.data.registry import tokenizer_of

    word_tokenizer(tmp_path / "model")
    model = f"hf:{tmp_path / 'model'}"
    assert tokenizer_of(make_config(model=model, data="text")) == str(tmp_path / "model")
    assert tokenizer_of(make_config(model=model, data="text", tokenizer="text")) == "text"  # --tokenizer wins
    assert tokenizer_of(make_config(model=model, data="digits")) is None  # no text: no tokenizer, no error
    assert tokenizer_of(make_config(model="transformer_lm", data="text")) is None  # bytes
