"""Language models trained through polytrain.fit, end to end, on the shipped text."""

import json

import pytest
import torch

import polytrain
from polytrain.data import build_data
from polytrain.data.batches import Slice, eval_batches
from polytrain.models import build_model
from polytrain.tasks import get_task

MODEL = "transformer_lm:layers=1,dim=32,heads=2"
DATA = "text:seq_len=32"
RUN = dict(strategy="single", model=MODEL, data=DATA, batch_size=16, optimizer="adam", lr=0.01, progress="off",
           log_every=1, eval_every=0, seed=0)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("lm")
    summary = polytrain.fit(steps=40, metrics_file=str(out / "m.jsonl"), save_model=str(out / "lm.pt"), **RUN)
    return summary, out


def _records(path, event):
    return [r for r in map(json.loads, open(path)) if r["event"] == event]


def test_a_transformer_lm_learns_the_shipped_text(trained):
    summary, out = trained
    losses = [r["loss"] for r in _records(out / "m.jsonl", "step")]
    assert len(losses) == 40 and summary["steps"] == 40
    # a uniform guess over 256 bytes costs ln 256 = 5.55; 40 Adam steps learn at least the byte frequencies
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.6
    state = torch.load(out / "lm.pt", weights_only=True)
    assert {"embed.tokens.weight", "blocks.0.attn.qkv.weight", "head.out.weight"} <= set(state)


def _token_mean_loss(state):
    bundle = build_data(DATA)
    model = build_model(MODEL, input_shape=bundle.input_shape, num_classes=bundle.num_outputs)
    model.load_state_dict(state)
    model.eval()
    task, sums = get_task("lm"), torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in eval_batches(bundle.test, 256, Slice(), torch.device("cpu")):
            sums += torch.stack([v.double() for v in task.score(model(x), y)])
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def test_evaluation_reports_the_mean_over_tokens_and_perplexity(trained):
    summary, out = trained
    loss, accuracy = _token_mean_loss(torch.load(out / "lm.pt", weights_only=True))
    assert summary["eval_loss"] == pytest.approx(loss, rel=1e-5)
    assert summary["eval_accuracy"] == pytest.approx(accuracy, rel=1e-5)
    end = _records(out / "m.jsonl", "end")[-1]
    assert end["eval_perplexity"] == pytest.approx(torch.tensor(loss).exp().item(), rel=1e-5)
    assert all("perplexity" in record for record in _records(out / "m.jsonl", "step"))


def _step_losses(path):
    return [r["loss"] for r in _records(path, "step")]


def _single_and_sync(tmp_path, **run):
    common = dict(RUN, eval_every=0, steps=10, **run)
    polytrain.fit(metrics_file=str(tmp_path / "single.jsonl"), **common)
    polytrain.fit(metrics_file=str(tmp_path / "sync.jsonl"), **{**common, "strategy": "sync", "workers": 2})
    return _step_losses(tmp_path / "single.jsonl"), _step_losses(tmp_path / "sync.jsonl")


def test_sync_equals_single_on_fixed_windows(tmp_path):
    # every slice holds the same number of tokens, so averaging the workers' means is already the token mean
    single, sync = _single_and_sync(tmp_path)
    assert len(single) == 10 and sync == pytest.approx(single, rel=1e-5)


def test_sync_equals_single_on_sentences_of_uneven_lengths(tmp_path):
    lines = [line for line in build_data("text").train.tokens.numpy().tobytes().split(b"\n") if line.strip()]
    corpus = tmp_path / "lines.txt"
    corpus.write_bytes(b"\n".join(lines[:400]))
    single, sync = _single_and_sync(tmp_path, model="rnn_lm:hidden=32", data=f"sentences:{corpus}", batch_size=8)
    assert len(single) == 10 and sync == pytest.approx(single, rel=1e-5)


def _saved(tmp_path, name, **run):
    path = tmp_path / f"{name}.pt"
    polytrain.fit(save_model=str(path), **run)
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("model, workers, accumulate", [
    (MODEL, 2, 1),
    ("rnn_lm:hidden=32,layers=1", 4, 2),
])
def test_clipped_sync_equals_clipped_single(tmp_path, model, workers, accumulate):
    """--clip-grad-norm clips the averaged (global) gradient, so every worker takes single's clipped step."""
    common = dict(RUN, model=model, steps=10, accumulate=accumulate, log_every=10)
    single = _saved(tmp_path, "single", clip_grad_norm=0.05, **common)
    sync = _saved(tmp_path, "sync", clip_grad_norm=0.05, **{**common, "strategy": "sync", "workers": workers})
    unclipped = _saved(tmp_path, "unclipped", **common)
    for key, value in single.items():  # relative to each tensor's norm: Adam magnifies rounding near zero
        assert (sync[key] - value).norm() <= 1e-5 * value.norm(), key
    assert any(not torch.allclose(unclipped[k], v) for k, v in single.items())  # the clipping was active
