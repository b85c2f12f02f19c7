"""A Hugging Face ``transformers`` model from a user factory trains through polytrain without a wrapper.

Optional: skipped where ``transformers`` is not installed (``pip install polytrain[interop]``).
"""

import pytest
import torch

import polytrain

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # every worker imports transformers (seconds each on a small machine)

GPT2 = "tests.train.hf_factory:gpt2"  # a module, so that spawned workers import the factory by name
# SGD, not Adam: GPT-2's key bias has a zero gradient in exact arithmetic (a softmax ignores a constant added to
# all of a query's scores), and Adam would scale the rounding noise there up to full-size steps
RUN = dict(model=GPT2, data="text:seq_len=32", batch_size=8, optimizer="sgd", lr=0.5, steps=10, progress="off",
           log_every=10, eval_every=0, seed=0)


def _saved(tmp_path, name, **run):
    path = tmp_path / f"{name}.pt"
    summary = polytrain.fit(save_model=str(path), **run)
    return torch.load(path, weights_only=True), summary


@pytest.mark.parametrize("loss", ["task", "model"])
def test_a_transformers_gpt2_trains_with_sync_equal_to_single(tmp_path, monkeypatch, loss):
    """--loss task scores the output's .logits with the lm task; --loss model takes GPT-2's own .loss,
    given labels=. Either way two sync workers take single's steps. The workers are forked from this process
    (POLYTRAIN_START_METHOD=fork), which has imported transformers already: a worker from the forkserver would
    import it anew (seconds each)."""
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    single, summary = _saved(tmp_path, "single", loss=loss, strategy="single", **RUN)
    sync, _ = _saved(tmp_path, "sync", loss=loss, strategy="sync", workers=2, **RUN)
    assert summary["steps"] == 10 and summary["train_loss"] < 5.3  # it learned (a uniform guess: ln 256 = 5.55)
    assert single.keys() == sync.keys() and "transformer.h.0.attn.c_attn.weight" in single
    for key, value in single.items():  # relative to each tensor's norm
        assert (sync[key] - value).norm() <= 1e-5 * value.norm(), key
