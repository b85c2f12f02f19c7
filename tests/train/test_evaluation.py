"""The end of a run saves before it evaluates, and evaluation's batches fit --memory-limit (train/evaluation.py):
a run whose evaluation of 256 examples at once would pass the limit sizes its batches and ends well; the same run
with --eval-batch-size made too large on purpose fails with one line that says the model was saved, and the
saved model and checkpoint are the first run's. A stop that lands on the last step saves the checkpoint and the
model and ends (exit 75) without the final evaluation."""

import json
import re

import pytest
import torch

from polytrain.api import make_config
from polytrain.train.evaluation import DEFAULT_EVAL_BATCH, EvalBatchSize

# a byte-level language model whose evaluation of all 239 test windows at once needs tens of MiB more than a
# training step of 8 (its hidden activations, attention and logits)
RUN = dict(strategy="single", model="transformer_lm:layers=2,dim=128,heads=4",
           data="text:seq_len=64,test_fraction=0.04", optimizer="adam", batch_size=8, steps=2, eval_every=0,
           progress="off", memory_limit="40MiB")


# the two runs in a fresh process, as the command runs them: the evaluation's batch is sized from the memory its
# first batches take, which a long-lived process (a test worker after hundreds of tests) may already hold freed.
# The process is forked from this process's forkserver (torch imported, nothing run), as a worker is.
def _two_runs(run: dict, d: str) -> None:
    import polytrain
    from polytrain.errors import MemoryLimitError

    # torch's one-off costs of a process's first run are paid first, under a limit that sets the same allocator
    # policy (the OpenMP pool's thread and its stack, the matrix and attention kernels' buffers: about 48 MiB on
    # an AVX-512 CPU, where the first run of this model under 56MiB failed in its first step and every later one
    # trained within 20 MiB), so that the limit below bounds this model's own needs on any CPU
    polytrain.fit(**dict(run, memory_limit="1GiB", steps=1))
    fitted = polytrain.fit(**run, save_model=d + "/fitted.pt", metrics_file=d + "/fitted.jsonl")
    try:
        polytrain.fit(**run, eval_batch_size=1000, checkpoint_dir=d + "/ck", save_model=d + "/failed.pt")
        message = None
    except MemoryLimitError as exc:
        message = str(exc)
    with open(d + "/runs.json", "w") as fh:
        json.dump([fitted, message, _stopped_on_the_last_step(run, d)], fh, default=str)


def _stopped_on_the_last_step(run: dict, d: str) -> list | None:
    """The run sends itself SIGTERM once step 2 of 2 is done: the stop lands on the last step."""
    import os

    import polytrain
    from polytrain.errors import RunStopped
    from polytrain.train.faults import KILL_ENV

    os.environ[KILL_ENV] = "rank=0,steps=2,signal=SIGTERM"
    try:
        polytrain.fit(**run, checkpoint_dir=d + "/stop", save_model=d + "/stopped.pt", metrics_file=d + "/stop.jsonl")
    except RunStopped as exc:
        return [str(exc), exc.exit_code]
    finally:
        del os.environ[KILL_ENV]
    return None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from polytrain.distributed.processes import start_context

    d = tmp_path_factory.mktemp("eval")
    proc = start_context().Process(target=_two_runs, args=(RUN, str(d)))
    proc.start()
    proc.join(600)
    assert proc.exitcode == 0, proc.exitcode
    fitted, message, stopped = json.loads((d / "runs.json").read_text())
    assert message is not None, "an evaluation of 1000 examples at once fitted the limit"
    return d, fitted, message, stopped


def test_under_a_limit_the_evaluation_is_sized_to_fit_where_256_at_once_would_not(runs):
    d, fitted, message, _ = runs
    assert fitted["steps"] == 2 and fitted["eval_loss"] is not None
    assert "in evaluation: give a smaller --eval-batch-size (now 1000 per worker)" in message  # all 239 at once fail


def test_an_evaluation_past_the_limit_fails_after_the_model_was_saved_and_says_where(runs):
    d, _, message, _ = runs
    (line,) = message.splitlines()
    assert re.fullmatch(r"\[rank 0\] out of memory under --memory-limit 40MiB per worker: .*; the final evaluation "
                        rf"failed after step 2 was saved \(checkpoint {re.escape(str(d / 'ck' / 'step-00000002.pt'))}; "
                        rf"--save-model {re.escape(str(d / 'failed.pt'))}\)", line), line
    saved, reference = torch.load(d / "failed.pt"), torch.load(d / "fitted.pt")
    checkpoint = torch.load(d / "ck" / "step-00000002.pt", weights_only=False)["model"]
    assert saved.keys() == reference.keys() == checkpoint.keys()
    assert all(torch.equal(saved[k], reference[k]) and torch.equal(checkpoint[k], reference[k]) for k in reference)


def test_the_batch_size_as_given_or_sized():
    given = make_config(eval_batch_size=7)
    assert EvalBatchSize(given, 48, 4, 1000).decide(None, None, None) == 7  # (nothing measured)
    assert EvalBatchSize(make_config(), 48, 4, 1000).size == DEFAULT_EVAL_BATCH  # no limit: 256
    limited = make_config(memory_limit="1GiB", accumulate=2)
    sized = EvalBatchSize(limited, 48, 4, 1000)
    assert sized.size is None and sized.micro == 6  # measured at its first evaluation, from training's 6
    small = EvalBatchSize(limited, 48, 4, 40)  # 10 test examples a worker: no room to measure a second batch
    assert small.decide(None, None, None) == 6



def test_a_stop_on_the_last_step_saves_the_checkpoint_and_the_model_and_does_not_evaluate(runs):
    d, _, _, stopped = runs
    assert stopped is not None, "the stop on the last step ended the run as if it was not stopped"
    message, code = stopped
    assert code == 75 and message == (f"stopped by SIGTERM after step 2, the last (no final evaluation; --save-model "
                                      f"{d / 'stopped.pt'}); checkpoint {d / 'stop' / 'step-00000002.pt'}: the same "
                                      "command with --resume evaluates it")
    events = [json.loads(line)["event"] for line in (d / "stop.jsonl").read_text().splitlines()]
    assert "eval" not in events and events[-1] == "end"
    saved, reference = torch.load(d / "stopped.pt"), torch.load(d / "fitted.pt")  # the same 2 steps as fitted's
    checkpoint = torch.load(d / "stop" / "step-00000002.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], reference[k]) and torch.equal(checkpoint[k], reference[k]) for k in reference)
