"""--loss task|model: the default step is unchanged, a model's own loss trains sync == single, clear errors."""

import json

import pytest
import torch
import torch.nn.functional as F

import polytrain
from polytrain.data import build_data
from polytrain.data.batches import BatchPlan
from polytrain.models import build_model
from polytrain.train.session import seed_everything
from tests.helpers.cli_batch import run_here

OWN = "tests.train.lm_factories:own_loss_lm"
TINY = "transformer_lm:layers=1,dim=32,heads=2"
RUN = dict(strategy="single", batch_size=8, optimizer="adam", lr=0.01, progress="off", log_every=1, eval_every=0,
           seed=0)


@pytest.fixture(scope="module")
def sentences(tmp_path_factory):
    """Sentences of uneven lengths, so the workers' slices hold different numbers of tokens."""
    lines = [line for line in build_data("text").train.tokens.numpy().tobytes().split(b"\n") if line.strip()]
    path = tmp_path_factory.mktemp("corpus") / "lines.txt"
    path.write_bytes(b"\n".join(lines[:400]))
    return f"sentences:{path}"


def _step_losses(path):
    return [r["loss"] for r in map(json.loads, open(path)) if r["event"] == "step"]


def _fit(tmp_path, name, **run):
    polytrain.fit(save_model=str(tmp_path / f"{name}.pt"), metrics_file=str(tmp_path / f"{name}.jsonl"), **run)
    return torch.load(tmp_path / f"{name}.pt", weights_only=True), _step_losses(tmp_path / f"{name}.jsonl")


def test_the_default_step_is_plain_pytorch_bit_for_bit(tmp_path):
    """With --loss task (the default) and one device, a step is exactly the textbook loop's: the token-mean
    cross-entropy, backward, Adam step; --loss changed nothing on that path."""
    run = dict(RUN, model=TINY, data="text:seq_len=32", steps=5)
    trained, _ = _fit(tmp_path, "default", **run)
    seed_everything(0)  # what the session does before it builds the data and the model
    bundle = build_data("text:seq_len=32")
    model = build_model(TINY, input_shape=bundle.input_shape, num_classes=bundle.num_outputs, seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    plan = BatchPlan(len(bundle.train), 8, seed=0)
    for step in range(5):
        x, y = bundle.train.get_batch(plan.global_indices(step), plan.position(step)[0])
        optimizer.zero_grad()
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100).backward()
        optimizer.step()
    for key, value in model.state_dict().items():
        assert torch.equal(trained[key], value), key


def _own_loss_on_first_batch(data):
    """The model's own loss (shifted labels) on step 0's whole batch, from the same initial weights."""
    seed_everything(0)
    bundle = build_data(data)
    model = build_model(OWN, input_shape=bundle.input_shape, num_classes=bundle.num_outputs, seed=0)
    x, y = bundle.train.get_batch(BatchPlan(len(bundle.train), 8, seed=0).global_indices(0))
    labels = x.masked_fill(y == -100, -100)
    with torch.no_grad():
        return model(x, labels=labels).loss.item(), model(x).logits, y


def test_model_loss_minimises_the_models_own_loss(tmp_path, sentences):
    _, losses = _fit(tmp_path, "own", **RUN, model=OWN, data=sentences, steps=3, loss="model")
    own, logits, targets = _own_loss_on_first_batch(sentences)
    task = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100).item()
    assert losses[0] == pytest.approx(own, rel=1e-6)
    assert abs(own - task) > 1e-3  # the two losses differ (the model leaves out each sentence's last target)


@pytest.mark.parametrize("workers, accumulate", [(2, 1), (4, 2)])
def test_model_loss_sync_equals_single(tmp_path, sentences, workers, accumulate):
    """Slices and micro-batches hold different numbers of labels; each is weighed by what the model's own
    loss averages over, so sync takes single's step."""
    run = dict(RUN, model=OWN, data=sentences, steps=10, loss="model", accumulate=accumulate)
    single, single_losses = _fit(tmp_path, "single", **run)
    sync, sync_losses = _fit(tmp_path, "sync", **{**run, "strategy": "sync", "workers": workers})
    task, _ = _fit(tmp_path, "task", **{**run, "loss": "task"})
    assert len(single_losses) == 10 and sync_losses == pytest.approx(single_losses, rel=1e-5)
    for key, value in single.items():  # relative to each tensor's norm: Adam magnifies rounding near zero
        assert (sync[key] - value).norm() <= 1e-5 * value.norm(), key
    assert any(not torch.allclose(task[k], v) for k, v in single.items())  # --loss model was in force


def test_the_opening_lines_say_which_loss(capsys):
    """The command's main in this process (single trains in the command's own process)."""
    text = ["--progress", "lines", "--eval-every", "0", "--batch-size", "8", "--data", "text:seq_len=16", "--steps",
            "1", "--strategy", "single"]
    model = run_here(capsys, "train", "--model", OWN, "--loss", "model", *text)
    task = run_here(capsys, "train", "--model", OWN, *text)
    assert model.returncode == 0 and task.returncode == 0, model.stderr + task.stderr
    assert "loss: the model's own .loss, given labels=" in model.stdout + model.stderr
    assert "loss: the task's (lm) loss on the model's outputs" in task.stdout + task.stderr


@pytest.mark.parametrize("model, strategy, message", [
    ("tests.train.lm_factories:no_loss_lm", ["--strategy", "sync", "--workers", "2"],
     "--loss model: the model returned no loss given labels= (Output without a .loss tensor)"),
    (TINY, ["--strategy", "single"], f"--loss model: the forward of --model {TINY} takes no labels= argument"),
])
def test_a_model_without_its_own_loss_is_one_line(capfd, monkeypatch, model, strategy, message):
    """Sync's workers find it at their first step, single in the command's own process; the command's main runs
    here (sync's workers forked from this process, POLYTRAIN_START_METHOD=fork, so that what they write is
    captured with the command's own output)."""
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    args = ["--model", model, "--loss", "model", "--data", "text:seq_len=16", "--steps", "5", *strategy]
    proc = run_here(capfd, "train", "--progress", "lines", "--eval-every", "0", "--batch-size", "8", *args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and message in lines[0], proc.stderr
    assert "step 1" not in proc.stdout  # nothing was trained


def test_lm_labels_are_the_inputs_with_padding_ignored():
    """Hugging Face causal LMs shift labels themselves, so they get the inputs; each sequence's last target
    has no label to its right and is the one unit the model's loss leaves out."""
    from polytrain.tasks import get_task
    task = get_task("lm")
    inputs = torch.tensor([[10, 1, 2, 3], [10, 4, 0, 0]])
    targets = torch.tensor([[1, 2, 3, 10], [4, 10, -100, -100]])
    labels = task.model_labels(inputs, targets)
    assert labels.tolist() == [[10, 1, 2, 3], [10, 4, -100, -100]]
    assert task.model_units(labels) == 3 + 1 == task.model_global_units(task.units(targets), len(targets))
