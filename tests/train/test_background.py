"""--checkpoint-background (train/background.py): the periodic checkpoints written by a thread from a copy of
the state hold exactly what the same run writes in the foreground (each rank's part under fsdp), every one passes
its checks, and the summary reports each periodic checkpoint's stall."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import polytrain
from polytrain.distributed.topology import Topology
from polytrain.train.background import CheckpointWrites, copy_state
from polytrain.train.checkpoint import Checkpointer
from polytrain.train.integrity import verify

RUN = dict(model="mlp", data="synthetic", optimizer="adam", batch_size=16, steps=6, checkpoint_every=2,
           keep_checkpoints=5, eval_every=0, progress="off", seed=3)
# fsdp: each rank's part written by its thread, committed at the next checkpoint (a whole state gathered to rank 0
# is written by the same thread: --snapshot-every's restart test resumes from one bit for bit, test_restart.py)
CASES = {"fsdp": dict(strategy="fsdp", workers=2)}


def _same(a, b, where=""):
    """Every tensor equal bit for bit, every other value equal (what a checkpoint file holds)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a.keys() - {"config"}:  # (the runs' settings differ in the option and the directory)
            _same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module", params=sorted(CASES))
def runs(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"background-{request.param}")
    summaries = {}
    for background in (False, True):
        summaries[background] = polytrain.fit(**RUN, **CASES[request.param], checkpoint_background=background,
                                              checkpoint_dir=str(d / str(background)))
    return request.param, d, summaries


def test_background_checkpoints_hold_what_the_foreground_writes(runs):
    name, d, summaries = runs
    fore, back = Checkpointer(d / "False"), Checkpointer(d / "True")
    assert back.steps() == fore.steps() == [2, 4, 6], name
    assert back.latest().name == "step-00000006.pt"
    for step in (2, 4, 6):
        files = sorted(p.name for p in (d / "True").glob(f"step-{step:08d}*"))
        assert files == sorted(p.name for p in (d / "False").glob(f"step-{step:08d}*")), (name, step)
        assert verify(back.path(step)).problem is None, (name, step)  # size, SHA-256, every part
        for file in files:
            if file.endswith(".pt"):
                _same(torch.load(d / "True" / file, weights_only=False),
                      torch.load(d / "False" / file, weights_only=False), f"{name}:{file}")
    assert not list(Path(d).rglob("*.tmp")), name


def test_the_summary_reports_each_periodic_checkpoints_stall(runs):
    name, _, summaries = runs
    for summary in summaries.values():
        stall = summary["checkpoint_stall_s"]
        assert stall["checkpoints"] == 2 and 0 <= stall["median"] <= stall["max"] <= stall["total"], (name, stall)
    assert summaries[True]["train_loss"] == summaries[False]["train_loss"], name


def test_the_copy_keeps_the_state_as_it_was_and_one_thread_writes_every_checkpoint():
    """The copy a background write reads from: tensors and containers copied (training changes them in place: the
    weights, an optimizer's lr), plain numbers shared; and one writer thread serves every write, in order."""
    live = {"w": torch.ones(2), "groups": [{"lr": 0.1, "params": [0, 1]}], "rng": [7] * 625,
            "pair": (1, torch.zeros(1))}
    copied = copy_state(live)
    live["w"].add_(1)
    live["groups"][0]["lr"], live["rng"][0] = 0.2, 8
    live["groups"][0]["params"].append(2)
    live["pair"][1].add_(1)
    assert copied == {"w": copied["w"], "groups": [{"lr": 0.1, "params": [0, 1]}], "rng": [7] * 625,
                      "pair": (1, copied["pair"][1])}
    assert copied["w"].tolist() == [1.0, 1.0] and copied["pair"][1].item() == 0.0
    def writers() -> int:
        return sum(t.name == "polytrain-checkpoint-write" for t in threading.enumerate())

    writes, before, done = CheckpointWrites(background=True), writers(), []
    for step in range(3):
        writes.start(lambda step=step: done.append(step) or step)
        assert writes.settle(Topology()) == step
    assert done == [0, 1, 2] and writers() == before + 1
    writes.close()  # (the run's end)
    assert writers() == before
