"""A finished ``pipeline``/``hybrid`` run resumed with nothing left to train: the split is measured in the
final evaluation (under ``no_grad``, in eval mode), which must work and leave the model as it was."""

import json

import pytest
import torch
from torch import nn

import polytrain
from polytrain.models.transformer_lm import transformer_lm
from polytrain.parallel.pp import split
from polytrain.parallel.pp.split import choose_split
from tests.helpers.cli_batch import run_here

MODEL = "transformer_lm:layers=4,dim=32,heads=2"


def _models():
    torch.manual_seed(0)
    dropout = transformer_lm((8,), 32, layers=2, dim=16, heads=2, dropout=0.2)
    normed = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.Linear(16, 3))
    return [(dropout, torch.randint(0, 32, (4, 8))), (normed, torch.randn(6, 8))]


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("which", [0, 1])
def test_measuring_leaves_grad_mode_model_and_random_streams_as_they_were(which, training):
    """Under no_grad (as in an evaluation) the units are still timed with autograd on; the modes, buffers,
    gradients and RNG come back as they were, and dropout does not make the units-in-order check fail."""
    model, sample = _models()[which]
    model.train(training)
    for param in model.parameters():
        param.grad = torch.full_like(param, 0.5)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with torch.no_grad():
        ms, same = split.measure(model, sample)
        assert not torch.is_grad_enabled()
    assert same and len(ms) == len(split.units(model)) and all(t > 0 for t in ms)
    assert all(module.training == training for module in model.modules())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_model_with_dropout_can_be_split():
    model, sample = _models()[0]
    chosen = choose_split(model, sample, 2, "auto")
    assert chosen.how == "measured" and len(chosen.cuts) == 1


MODEL_ARGS = dict(model=MODEL, data="text:seq_len=16", batch_size=8, optimizer="sgd", lr=0.1, steps=10,
                  checkpoint_every=5, eval_every=0, log_every=5, seed=0, progress="off", timeout=60)


def _end(path):
    return next(e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == "end")


@pytest.mark.parametrize("layout", [dict(strategy="pipeline", stages=2),
                                    dict(strategy="hybrid", workers=4, dp=2, pp=2, microbatches=2)],
                         ids=["pipeline", "hybrid"])
def test_a_finished_run_resumed_evaluates_its_model_and_says_nothing_was_left(capfd, monkeypatch, tmp_path, layout):
    # both runs in this process, not as python -m polytrain (a fresh process's imports saved each): the first
    # through fit, the resumed one, whose output is checked, through the command's main. Their workers are
    # forked from this process (POLYTRAIN_START_METHOD=fork), so that what rank 0 prints reaches this test's
    # capfd: a worker from a forkserver started earlier writes to the forkserver's stdout
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    checkpoints = str(tmp_path / "c")
    polytrain.fit(**MODEL_ARGS, **layout, checkpoint_dir=checkpoints, metrics_file=str(tmp_path / "a.jsonl"),
                  save_model=str(tmp_path / "a.pt"))
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in {**MODEL_ARGS, **layout}.items()]
    again = run_here(capfd, "train", *flags, "--checkpoint-dir", checkpoints, "--resume", "--metrics-file",
                     str(tmp_path / "b.jsonl"), "--save-model", str(tmp_path / "b.pt"))
    assert again.returncode == 0 and "Traceback" not in again.stderr and "error" not in again.stderr, again.stderr
    warning = (f"warning: --resume: the checkpoint in {checkpoints} is at step 10, at or past --steps 10: nothing "
               "left to train (the model stays at step 10); raise --steps to train further")
    assert again.stdout.splitlines().count(warning) == 1, again.stdout
    assert "pipeline split (measured" in again.stdout  # cut for the evaluation
    done = [line for line in again.stdout.splitlines() if line.startswith("done:")]
    assert done == [line for line in done if line.startswith("done: nothing trained: the run was already at step "
                                                              "10 when it resumed")] and len(done) == 1
    assert "train loss" not in again.stdout and "examples/sec" not in again.stdout
    a, b = _end(tmp_path / "a.jsonl"), _end(tmp_path / "b.jsonl")
    assert b["steps"] == 10 and b["train_loss"] is None
    assert b["eval_loss"] == pytest.approx(a["eval_loss"], rel=1e-6)  # the same model, evaluated alike
    first_weights, weights = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in "ab")
    assert first_weights.keys() == weights.keys()
    assert all(torch.equal(first_weights[k], weights[k]) for k in weights)
