import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from polytrain.errors import ConfigError
from polytrain.train.checkpoint import (Checkpointer, capture_rng, check_checkpoint_dir, load_checkpoint,
                                         restore_rng)
from polytrain.train.files import atomic_save


def test_save_keeps_newest_and_points_latest(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2)
    for step in (10, 20, 30):
        ckpt.save({"model": {"w": torch.full((2,), float(step))}}, step)
    assert ckpt.steps() == [20, 30]
    assert ckpt.latest().name == "step-00000030.pt"
    state = ckpt.load_latest()
    assert state["step"] == 30 and torch.equal(state["model"]["w"], torch.full((2,), 30.0))


def test_checkpoint_loads_with_weights_only(tmp_path):
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save({"rng": [capture_rng()], "model": {"w": torch.ones(1)}}, 1)
    torch.load(path, weights_only=True)  # raises if anything needs full pickle


def test_rng_round_trip():
    state = capture_rng()
    first = (torch.rand(3), random.random(), np.random.rand())
    restore_rng(state)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_failed_save_leaves_previous_latest(tmp_path):
    ckpt = Checkpointer(tmp_path)
    ckpt.save({"model": {"w": torch.ones(1)}}, 1)

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError("disk full (simulated)")

    with pytest.raises(RuntimeError, match="simulated"):
        ckpt.save({"model": {"w": torch.zeros(1)}, "boom": Unpicklable()}, 2)
    assert ckpt.latest().name == "step-00000001.pt"
    assert ckpt.steps() == [1]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # the partial file was removed


WRITER = textwrap.dedent("""
    import sys, time, torch
    from polytrain.train.checkpoint import Checkpointer

    class StopsMidSave:  # pickled inside torch.save: the second save is under way, its file open, and stays so
        def __reduce__(self):
            print("second save started", flush=True)
            time.sleep(600)

    ckpt = Checkpointer(sys.argv[1])
    ckpt.save({"model": {"w": torch.ones(4)}}, 1)
    ckpt.save({"model": {"w": torch.randn(1000)}, "pause": StopsMidSave()}, 2)
""")


def test_process_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path, cli_env):
    # the kill lands while the writer is held inside the second save, whatever the machine's load
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], env=cli_env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "second save started"
        assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")], "the second save's file is open"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = Checkpointer(tmp_path)
    assert ckpt.latest().name == "step-00000001.pt"
    assert torch.equal(ckpt.load_latest()["model"]["w"], torch.ones(4))


def test_atomic_save_replaces_whole_file(tmp_path):
    target = tmp_path / "model.pt"
    atomic_save({"a": torch.ones(2)}, target)
    atomic_save({"a": torch.zeros(3)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["a"], torch.zeros(3))


def test_foreign_file_is_rejected_clearly(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"hello": 1}, path)
    with pytest.raises(ConfigError, match="is not a polytrain checkpoint"):
        load_checkpoint(path)


def test_checkpoint_dir_is_created_and_left_without_the_probe(tmp_path):
    target = tmp_path / "new" / "ckpt"
    check_checkpoint_dir(str(target))
    assert target.is_dir() and list(target.iterdir()) == []


@pytest.mark.parametrize("where", ["/proc/forbidden", "{tmp}/a-file/ckpt"])
def test_a_directory_that_cannot_be_made_is_one_error(tmp_path, where):
    # both fail for root too (this suite may run as root, for whom permission bits do not apply)
    (tmp_path / "a-file").write_text("not a directory")
    where = where.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=rf"^--checkpoint-dir {where}: cannot create or write this directory"):
        check_checkpoint_dir(where)
