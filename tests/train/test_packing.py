"""``--pack``: documents packed into full sequences compute exactly what each document alone computes (loss
and gradient), sync equals single on them, the efficiency is reported, and what cannot pack is refused."""

import json

import numpy as np
import pytest
import torch

import polytrain
from polytrain.data.spans import Spans, document_ends, pack
from polytrain.data.tokens import IGNORE_INDEX
from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.tasks import LanguageModelTask, packed_task

EOS = 0
DOC_A, DOC_B = [5, 9, 3, 7, 7, 2, 8, EOS], [4, 6, 1, 1, 3, EOS]


def _packed_pair():
    stream = np.array(DOC_A + DOC_B, dtype=np.uint16)
    starts, stops, rows = pack(document_ends(stream, EOS), seq_len=16)
    data = Spans(stream, starts, stops, EOS, rows, pad_to=16)
    assert len(data) == 1  # both documents in one sequence, padded to 16
    return data.get_batch(torch.tensor([0]))


def _loss_and_grads(model, inputs, targets, task):
    model.zero_grad()
    logits = model(inputs, **task.model_kwargs(inputs))
    logits = getattr(logits, "logits", logits)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), targets.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _each_document_as_alone(model, name):
    model.eval()  # (no dropout either way)
    x, y = _packed_pair()
    task = packed_task(EOS, model, name)
    for doc, mine in ((DOC_A, slice(0, len(DOC_A))), (DOC_B, slice(len(DOC_A), len(DOC_A) + len(DOC_B)))):
        only = torch.full_like(y, IGNORE_INDEX)
        only[:, mine] = y[:, mine]  # the packed batch, scored on this document's targets only
        packed = _loss_and_grads(model, x, only, task)
        alone = _loss_and_grads(model, torch.tensor([doc[:-1]]), torch.tensor([doc[1:]]), LanguageModelTask())
        assert packed[0] == pytest.approx(alone[0], abs=1e-6)
        for key, grad in alone[1].items():
            assert (packed[1][key] - grad).abs().max() <= 1e-6, key


def test_each_packed_document_gets_its_own_loss_and_gradient_in_transformer_lm():
    torch.manual_seed(0)
    model = build_model("transformer_lm:layers=2,dim=16,heads=2", input_shape=(16,), num_classes=10)
    _each_document_as_alone(model.double(), "transformer_lm")


def test_each_packed_document_gets_its_own_loss_and_gradient_in_a_transformers_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    model = transformers.LlamaForCausalLM(config).double()  # use_cache on, as configs have it: polytrain turns it off
    assert packed_task(EOS, model, "llama").extra == {"use_cache": False}
    _each_document_as_alone(model, "llama")


@pytest.fixture(scope="module")
def packed_runs(tmp_path_factory):
    pytest.importorskip("tokenizers")
    out = tmp_path_factory.mktemp("pack")
    docs = [f"{w.upper()}, n. " + " ".join([w] * (i % 9 + 1)) for i, w in enumerate(["love", "war", "dog"] * 40)]
    (out / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    # SGD: the key bias has no gradient in exact arithmetic, and Adam would scale its rounding noise up
    run = dict(model="transformer_lm:layers=1,dim=16,heads=2", data=f"hf:{out / 'd.jsonl'},seq_len=32",
               tokenizer="text", pack=True, batch_size=8, steps=6, optimizer="sgd", lr=0.5, progress="off",
               log_every=6, eval_every=0, seed=0)
    single = polytrain.fit(strategy="single", save_model=str(out / "single.pt"), **run)
    sync = polytrain.fit(strategy="sync", workers=2, save_model=str(out / "sync.pt"), **run)
    return out, single, sync


def test_packed_sync_equals_single(packed_runs):
    out, single, _ = packed_runs
    one, two = (torch.load(out / f"{n}.pt", weights_only=True) for n in ("single", "sync"))
    for key, value in one.items():
        assert (two[key] - value).norm() <= 1e-5 * value.norm(), key


def test_the_summary_reports_the_packed_efficiency(packed_runs):
    _, single, sync = packed_runs
    assert 0.5 < single["packed_efficiency"] == sync["packed_efficiency"] <= 1
    from polytrain.cli.train import format_summary

    assert "packed documents: " in format_summary({**single, "wall_s": 1.0})


def test_what_cannot_pack_is_refused_before_anything_starts(tmp_path):
    stream = np.array((DOC_A + DOC_B) * 30, dtype=np.uint16)
    stream.tofile(tmp_path / "t.bin")
    data = f"tokens:{tmp_path / 't.bin'},seq_len=16,eos=0"
    common = dict(data=data, pack=True, steps=1, batch_size=4, progress="off")
    with pytest.raises(ConfigError, match="--pack: the forward of --model rnn_lm takes no position_ids=, so it "
                                          "cannot keep each packed document to itself; use a model that takes"):
        polytrain.fit(model="rnn_lm", **common)
    with pytest.raises(ConfigError, match="--pack: --strategy pipeline's stages pass one another activations only"):
        polytrain.fit(model="transformer_lm", strategy="pipeline", workers=2, **common)
    with pytest.raises(ConfigError, match="--pack with --loss model: a model's own loss shifts the labels itself"):
        polytrain.fit(model="transformer_lm", loss="model", **common)
    with pytest.raises(ConfigError, match="--pack: --data text has no documents to pack"):
        polytrain.fit(model="transformer_lm", **{**common, "data": "text"})


def test_a_vocabulary_larger_than_the_models_is_refused_before_launch(tmp_path):
    np.arange(400, dtype=np.uint16).tofile(tmp_path / "t.bin")
    with pytest.raises(ConfigError, match=r"--model transformer_lm: its vocabulary of 300 tokens is smaller than "
                                          r"the data's token ids \(up to 399"):
        polytrain.fit(model="transformer_lm", model_args={"vocab": 300}, data=f"tokens:{tmp_path / 't.bin'},seq_len=8",
                      strategy="sync", workers=2, steps=1, batch_size=4, progress="off")
