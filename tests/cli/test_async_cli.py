"""`polytrain train --strategy async` from the command line: bad settings, --help, the opening lines (the bad
settings and --help, which start nothing, through the command's ``main`` in this process)."""

import pytest

from tests.cli.test_train import polytrain
from tests.helpers.cli_batch import run_here


@pytest.mark.parametrize("args, message", [
    (["--servers", "0"], "--servers: must be >= 1, got 0"),
    (["--staleness", "-1"], "--staleness: must be >= 0, got -1"),
    (["--tolerate-worker-loss", "--workers", "2", "--heartbeat-timeout", "0"], "needs the heartbeat"),
    (["--batch-size", "33", "--workers", "2"], "--batch-size 33 does not divide over 2 workers"),
    (["--overlap", "--staleness", "0"], "which --staleness 0 forbids"),
    (["--overlap", "--tolerate-worker-loss", "--workers", "2"], "--tolerate-worker-loss hands a lost worker's"),
])
def test_bad_async_settings_are_one_line_before_anything_starts(capsys, args, message):
    proc = run_here(capsys, "train", "--strategy", "async", "--steps", "1", *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr


def test_help_says_what_the_batch_size_is_for_async(capsys):
    proc = run_here(capsys, "train", "--help-all")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    assert ("--batch-size counts one step: N slices of batch/N examples, each computed by whichever worker is free "
            "and applied alone, scaled by 1/N; --steps counts such steps over all workers") in text
    assert "--staleness K" in text and "--servers S" in text


def test_an_async_run_says_what_it_runs_and_what_a_batch_is(cli_env):
    proc = polytrain("--strategy", "async", "--workers", "2", "--servers", "2", "--staleness", "1", "--overlap",
                     "--model", "mlp:hidden=16", "--steps", "12", "--batch-size", "32", "--progress", "lines",
                     "--timeout", "60", env=cli_env)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert ("async: 2 worker(s) (ranks 0-1) + 2 parameter server(s) (ranks 2-3), staleness bound 1" in out)
    assert "parameters cut over the servers, gradients and values through shared memory" in out  # (one machine)
    assert "--overlap: each slice's parameters are pulled while the slice before computes" in out
    assert ("--batch-size 32 counts one step: 2 slices of 16 examples, handed to whichever worker is free, each "
            "applied alone at lr/2") in out
    assert "done: 12 steps" in out and "with async on 2 worker(s)" in out


def test_a_lost_helper_is_named_in_the_summary_and_the_run_ends_well(cli_env, tmp_path):
    env = {**cli_env, "POLYTRAIN_INJECT_KILL": "rank=1,steps=5"}
    proc = polytrain("--strategy", "async", "--workers", "3", "--tolerate-worker-loss", "--heartbeat-timeout", "4",
                     "--model", "mlp:hidden=16", "--steps", "30", "--batch-size", "48", "--timeout", "60",
                     "--save-model", str(tmp_path / "model.pt"), env=env,
                     timeout=600)  # a hang guard: at load 58 on 2 cores its start-up alone took minutes
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout + proc.stderr
    assert "worker rank 1 was killed by signal SIGKILL; going on without it (--tolerate-worker-loss)" in out
    assert "done: 30 steps" in out and "on 3 worker(s)" in out
    assert "workers lost: rank(s) 1; the run went on without them" in out
    assert (tmp_path / "model.pt").exists()
