"""The run's start (the summary's ``startup_s``) travels to its workers in the environment, as does where hang
reports go; a program that trains from inside (a notebook, a test suite) has its own environment back after."""

import os

import polytrain
from polytrain.cli.main import main
from polytrain.distributed.hangs import RUN_DIR_ENV
from polytrain.train.startup import ENV as STARTED_AT_ENV


def test_fit_and_main_leave_the_callers_environment_as_they_found_it(tmp_path, monkeypatch):
    monkeypatch.delenv(STARTED_AT_ENV, raising=False)
    monkeypatch.setenv(RUN_DIR_ENV, "/the/callers/own")
    summary = polytrain.fit(model="mlp:hidden=8", data="digits", strategy="single", steps=2, eval_every=0,
                            progress="off", checkpoint_dir=str(tmp_path / "ck"))
    assert summary["startup_s"] >= 0  # (the mark was there for the run)
    assert STARTED_AT_ENV not in os.environ and os.environ[RUN_DIR_ENV] == "/the/callers/own"
    monkeypatch.delenv(RUN_DIR_ENV)
    assert main(["train", "--model", "mlp:hidden=8", "--data", "digits", "--strategy", "single", "--steps", "2",
                 "--eval-every", "0", "--progress", "off", "--checkpoint-dir", str(tmp_path / "ck2")]) == 0
    assert STARTED_AT_ENV not in os.environ and RUN_DIR_ENV not in os.environ
