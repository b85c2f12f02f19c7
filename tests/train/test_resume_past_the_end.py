"""``--resume`` from a checkpoint at or past the run's last step: one warning that nothing is left to train,
and an end summary that says nothing was trained (the model is evaluated and kept as it is)."""

import json

import pytest
import torch

import polytrain
from polytrain.cli.train import format_summary
from tests.helpers.cli_batch import run_here

COMMON = ["--strategy", "sync", "--workers", "2", "--model", "mlp:hidden=32", "--data", "digits", "--batch-size",
          "32", "--seed", "3", "--eval-every", "0", "--progress", "off"]


def _end(tmp_path, name):
    return next(e for e in map(json.loads, (tmp_path / f"{name}.jsonl").read_text().splitlines())
                if e.get("event") == "end")


def test_resuming_a_finished_sync_run_trains_nothing_and_says_so(capfd, monkeypatch, tmp_path):
    """The first run through the API in this process (its workers from this process's forkserver); the two
    resumed ones through the command's main in this process too, their workers forked from it
    (POLYTRAIN_START_METHOD=fork), so that what rank 0 writes is captured with the command's own output."""
    def paths(name):
        return ["--checkpoint-dir", str(tmp_path / "c"), "--metrics-file", str(tmp_path / f"{name}.jsonl"),
                "--save-model", str(tmp_path / f"{name}.pt")]

    polytrain.fit(strategy="sync", workers=2, model="mlp:hidden=32", data="digits", batch_size=32, seed=3,
                  eval_every=0, progress="off", epochs=1, checkpoint_dir=str(tmp_path / "c"),
                  metrics_file=str(tmp_path / "first.jsonl"), save_model=str(tmp_path / "first.pt"))
    first, weights = _end(tmp_path, "first"), torch.load(tmp_path / "first.pt", weights_only=True)
    steps, where = first["steps"], tmp_path / "c"
    assert steps > 5 and first["train_loss"] is not None
    cases = [
        ("same", ["--epochs", "1"], f"at or past the end of --epochs 1 (step {steps}): nothing left to train (the "
                                    f"model stays at step {steps}); raise --epochs to train further"),
        ("fewer", ["--steps", "5"], f"at or past --steps 5: nothing left to train (the model stays at step {steps}); "
                                    "raise --steps to train further"),
    ]
    monkeypatch.setenv("POLYTRAIN_START_METHOD", "fork")
    for name, args, warning in cases:
        proc = run_here(capfd, "train", *COMMON, *paths(name), "--resume", *args)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        end, kept = _end(tmp_path, name), torch.load(tmp_path / f"{name}.pt", weights_only=True)
        out = proc.stdout
        lines = out.splitlines()
        assert [line for line in lines if "nothing left" in line] == \
            [f"warning: --resume: the checkpoint in {where} is at step {steps}, {warning}"], out
        assert lines[-2:] == [f"done: nothing trained: the run was already at step {steps} when it resumed (raise "
                              f"--steps or --epochs to train further); {lines[-2].rsplit('; ', 1)[1]}",
                              f"  eval loss {first['eval_loss']:.4f}  eval accuracy {first['eval_accuracy']:.4f}"], out
        assert end["steps"] == steps and end["train_loss"] is None
        assert end["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-9)
        assert all(torch.equal(kept[k], weights[k]) for k in weights)


def test_a_trained_run_and_one_after_restarts_keep_the_usual_summary():
    trained = dict(steps=20, wall_s=3.0, strategy="sync", workers=2, examples_per_sec=100.0, train_loss=0.5,
                   eval_loss=0.4, eval_accuracy=0.9)
    assert format_summary(trained).splitlines()[:2] == ["done: 20 steps in 3.0 s with sync on 2 worker(s)",
                                                        "  train loss 0.5000  eval loss 0.4000  eval accuracy 0.9000"]
    # the last attempt resumed at the end, but the ones before it trained: the restarts line says so
    restarted = dict(trained, train_loss=None, examples_per_sec=0.0, restarts=1,
                     restart_causes=[dict(cause="worker rank 1 was killed by signal SIGKILL", after_s=1.4)])
    text = format_summary(restarted)
    assert text.startswith("done: 20 steps in 3.0 s") and "nothing trained" not in text and "restarts: 1" in text
    nothing = format_summary(dict(trained, train_loss=None, examples_per_sec=0.0, eval_loss=None,
                                  eval_accuracy=None))
    assert nothing == ("done: nothing trained: the run was already at step 20 when it resumed (raise --steps or "
                       "--epochs to train further); 3.0 s with sync on 2 worker(s)")
