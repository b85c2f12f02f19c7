"""``polytrain generate`` on models that polytrain train saved."""

import pytest
import torch
from torch import nn

import polytrain
from polytrain.cli.main import main
from polytrain.train.checkpoint import Checkpointer

MODEL = "transformer_lm:layers=1,dim=16,heads=2"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gen")
    polytrain.fit(strategy="single", model=MODEL, data="text:seq_len=24", steps=3, batch_size=8, progress="off",
                  eval_every=0, save_model=str(out / "lm.pt"), checkpoint_dir=str(out / "ckpt"))
    polytrain.fit(strategy="single", model="rnn_lm", model_args={"hidden": 16, "layers": 1}, data="text:seq_len=24",
                  steps=2, batch_size=8, progress="off", eval_every=0, checkpoint_dir=str(out / "rnn"))
    return out


def generate(capsys, *args):
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_continues_the_prompt_and_repeats_with_the_seed(run_dir, capsys):
    weights = ["--weights", str(run_dir / "lm.pt"), "--model", MODEL]
    code, first, _ = generate(capsys, *weights, "--prompt", "LOVE, n.", "--tokens", "30", "--seed", "4")
    assert code == 0 and first.startswith("LOVE, n.")
    assert len(first.rstrip("\n").encode("utf-8", errors="surrogateescape")) >= len("LOVE, n.") + 1
    assert generate(capsys, *weights, "--prompt", "LOVE, n.", "--tokens", "30", "--seed", "4")[1] == first
    assert generate(capsys, *weights, "--prompt", "LOVE, n.", "--tokens", "30", "--seed", "5")[1] != first
    greedy = [generate(capsys, *weights, "--tokens", "10", "--temperature", "0", "--seed", s)[1] for s in "12"]
    assert greedy[0] == greedy[1]  # no sampling: the seed does not matter


def test_prompts_longer_than_the_positions_use_the_last_ones(run_dir, capsys):
    code, out, _ = generate(capsys, "--weights", str(run_dir / "lm.pt"), "--model", MODEL, "--prompt", "x" * 100,
                            "--tokens", "5")
    assert code == 0 and out.startswith("x" * 100)


@pytest.mark.parametrize("run", ["ckpt", "rnn"])
def test_a_checkpoint_names_its_own_model_and_arguments(run_dir, capsys, run):
    code, out, err = generate(capsys, "--checkpoint-dir", str(run_dir / run), "--prompt", "A", "--tokens", "8")
    assert code == 0 and out.startswith("A"), err


def test_weights_that_do_not_fit_the_model_are_one_line(run_dir, capsys):
    code, out, err = generate(capsys, "--weights", str(run_dir / "lm.pt"), "--model",
                              "transformer_lm:layers=2,dim=16,heads=2")
    assert code == 2 and out == ""
    assert err.startswith("polytrain: error: the weights do not fit --model transformer_lm:layers=2")
    assert err.count("\n") == 1


@pytest.mark.parametrize("args, message", [
    (["--weights", "lm.pt"], "--model is needed with --weights"),
    (["--weights", "missing.pt", "--model", "rnn_lm"], "--weights missing.pt: cannot read it"),
    (["--checkpoint-dir", "nowhere"], "--checkpoint-dir nowhere: no checkpoint there"),
    (["--weights", "lm.pt", "--model", MODEL, "--model-arg", "dim"], "--model-arg: expected key=value, got 'dim'"),
    (["--weights", "lm.pt", "--model", MODEL, "--tokens", "-1"], "--tokens must be >= 0, got -1"),
    (["--weights", "lm.pt", "--model", MODEL, "--temperature", "-1"],
     "--temperature must be a finite number >= 0 (0 always takes the likeliest token), got -1.0"),
    (["--weights", "lm.pt", "--model", MODEL, "--temperature", "nan"], "--temperature must be a finite number"),
    (["--weights", "lm.pt", "--model", MODEL, "--temperature", "inf"], "--temperature must be a finite number"),
])
def test_bad_sources_are_one_line(run_dir, capsys, monkeypatch, args, message):
    monkeypatch.chdir(run_dir)
    code, _, err = generate(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1


WANTED = "give the file 'polytrain train --save-model FILE' wrote (a state_dict: tensors by name)"


def _write(where, name, content):
    """Files that are no model's weights, made for real: text, bytes, other objects torch.save wrote."""
    path = where / name
    if name == "dir":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    return str(path)


@pytest.mark.parametrize("name, content, message", [
    ("empty.pt", b"", f"the file is empty; {WANTED}"),
    ("notes.txt", b"hello, not weights\n", "not a file of tensors torch.save wrote, or a damaged one (KeyError: "),
    ("garbage.pt", bytes(range(256)) * 4, "not a file of tensors torch.save wrote, or a damaged one (Unpickling"),
    ("dir", None, f"a directory, not a weights file; {WANTED}, or the run's checkpoints with --checkpoint-dir DIR"),
    ("list.pt", [torch.ones(2)], f"holds a list, not a state_dict; {WANTED}"),
    ("tensor.pt", torch.ones(2), f"holds a Tensor, not a state_dict; {WANTED}"),
    ("none.pt", {}, f"holds an empty dict, no tensors; {WANTED}"),
    ("nested.pt", {"model": {"w": torch.ones(2)}}, f"not a state_dict: it maps 'model' to a dict, not to a tensor; "
                                                   f"{WANTED}"),
])
def test_a_file_that_is_no_state_dict_is_one_line_naming_it(tmp_path, capsys, name, content, message):
    path = _write(tmp_path, name, content)
    code, out, err = generate(capsys, "--weights", path, "--model", MODEL)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"polytrain: error: --weights {path}: {message}"), err


def test_dev_null_a_truncated_file_and_a_checkpoint_as_weights_are_one_line(run_dir, tmp_path, capsys):
    code, _, err = generate(capsys, "--weights", "/dev/null", "--model", MODEL)
    assert (code, err) == (2, f"polytrain: error: --weights /dev/null: the file is empty; {WANTED}\n")
    whole = (run_dir / "lm.pt").read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(whole[: len(whole) // 2])
    code, _, err = generate(capsys, "--weights", str(cut), "--model", MODEL)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"polytrain: error: --weights {cut}: not a file of tensors torch.save wrote, or a damaged "
                          "one (") and err.endswith(f"); {WANTED}\n")  # what torch says depends on where it ends
    checkpoint = str(Checkpointer(run_dir / "ckpt").latest())
    code, _, err = generate(capsys, "--weights", checkpoint, "--model", MODEL)
    assert (code, err) == (2, f"polytrain: error: --weights {checkpoint}: a polytrain checkpoint, not a model's "
                              "weights; pass its directory with --checkpoint-dir DIR (or write the weights with "
                              "'polytrain checkpoint export')\n")


def test_a_checkpoint_without_a_model_is_one_line(tmp_path, capsys):
    Checkpointer(tmp_path / "c").save({"config": {"model": MODEL}}, 1)
    code, _, err = generate(capsys, "--checkpoint-dir", str(tmp_path / "c"))
    assert (code, err) == (2, f"polytrain: error: --checkpoint-dir {tmp_path / 'c'}: its latest checkpoint holds no "
                              "model state_dict; use the directory of a run that polytrain train checkpointed\n")


NOT_AN_LM = ("is not a byte-level language model ({why}); generate samples from a model that maps byte ids to "
             "next-byte logits: rnn_lm, transformer_lm, or your own factory of one\n")


@pytest.fixture(scope="module")
def classifiers(tmp_path_factory):
    out = tmp_path_factory.mktemp("classifiers")
    for model in ("digits_cnn", "mlp"):
        polytrain.fit(strategy="single", model=model, data="digits", steps=1, batch_size=8, progress="off",
                      eval_every=0, save_model=str(out / f"{model}.pt"), checkpoint_dir=str(out / model))
    return out


@pytest.mark.parametrize("model, why", [("digits_cnn", "it does not take byte ids"),
                                        ("mlp", "it has no token embedding")])
def test_a_classifier_is_not_a_language_model(classifiers, capsys, model, why):
    code, out, err = generate(capsys, "--checkpoint-dir", str(classifiers / model))
    assert (code, out) == (2, "")
    assert err == f"polytrain: error: the run's model {model} (trained on digits) " + NOT_AN_LM.format(why=why)
    code, _, err = generate(capsys, "--weights", str(classifiers / f"{model}.pt"), "--model", model)
    assert err == f"polytrain: error: --model {model} " + NOT_AN_LM.format(why=why)


def embedding_classifier(num_classes: int = 256) -> nn.Module:
    """A model with a token embedding that classifies a whole sequence: no next-byte logits."""
    return nn.Sequential(nn.Embedding(num_classes, 4), nn.Flatten(), nn.Linear(4, 3))


def test_a_model_without_next_byte_logits_is_not_a_language_model(tmp_path, capsys):
    spec = f"{__name__}:embedding_classifier"
    torch.save(embedding_classifier().state_dict(), tmp_path / "w.pt")
    code, _, err = generate(capsys, "--weights", str(tmp_path / "w.pt"), "--model", spec)
    why = "for 1 byte id it gives outputs of shape (1, 3), not (1, 1, vocab)"
    assert (code, err) == (2, f"polytrain: error: --model {spec} " + NOT_AN_LM.format(why=why))


def test_a_prompt_that_is_not_utf8_is_continued(run_dir, capsys):
    """Bytes a shell passes that are not UTF-8 reach Python as surrogates: sampled after, printed as U+FFFD."""
    code, out, _ = generate(capsys, "--weights", str(run_dir / "lm.pt"), "--model", MODEL, "--prompt", "a\udcffb",
                            "--tokens", "3", "--temperature", "0")
    assert code == 0 and out.startswith("a\ufffdb")


def test_a_run_with_a_tokenizer_samples_its_tokens(tmp_path, capsys):
    pytest.importorskip("tokenizers")
    polytrain.fit(strategy="single", model=MODEL, data="text:seq_len=24", tokenizer="text", steps=2, batch_size=8,
                  progress="off", eval_every=0, checkpoint_dir=str(tmp_path / "ckpt"))
    capsys.readouterr()
    code, out, err = generate(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--prompt", "WAR, n.",
                              "--tokens", "5", "--temperature", "0")
    assert code == 0 and out.startswith("WAR, n."), err
    from polytrain.data.tokenizer import load_tokenizer
    from polytrain.models.sampling import sample_tokens

    tok = load_tokenizer("text")
    state = Checkpointer(str(tmp_path / "ckpt")).load_latest()["model"]
    model = polytrain.models.build_model(MODEL, input_shape=(24,), num_classes=1024)
    model.load_state_dict(state)
    ids = tok.encode("WAR, n.")
    assert out.rstrip("\n") == tok.decode(ids + sample_tokens(model, ids, 5, temperature=0)).rstrip("\n")
    code, _, err = generate(capsys, "--checkpoint-dir", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "no"))
    assert code == 2 and "--tokenizer" in err and err.count("\n") == 1


def test_a_tokenizer_larger_than_the_models_vocabulary_is_one_line(run_dir, capsys):
    pytest.importorskip("tokenizers")
    code, out, err = generate(capsys, "--weights", str(run_dir / "lm.pt"), "--model", MODEL, "--tokenizer", "text")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "--tokenizer text: its vocabulary of 1024 tokens is larger than the model's 256" in err
