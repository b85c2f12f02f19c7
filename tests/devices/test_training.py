"""The device flags inside a real training run (the Trainer in this process, strategy single)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from polytrain.config import make_config
from polytrain.devices.discovery import available_device_names
from polytrain.errors import DeviceError
from polytrain.train.trainer import Trainer
from tests.devices.helpers import ListHandler

# mlp:hidden=16 is Sequential(0 Flatten, 1 Linear, 2 ReLU, 3 Linear)
BASE = dict(strategy="single", data="digits", model="mlp:hidden=16", batch_size=32, steps=4, log_every=1,
            eval_every=0, progress="off", seed=3)
NO_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="cuda:1 exists here")


@pytest.fixture
def device_log():
    """Records of the ``polytrain.devices`` logger, whatever the ``polytrain`` logger is set to."""
    logger = logging.getLogger("polytrain.devices")
    handler, level = ListHandler(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def _train(tmp_path, name: str, **settings):
    metrics = tmp_path / f"{name}.jsonl"
    trainer = Trainer(make_config(**dict(BASE, metrics_file=str(metrics), **settings)))
    trainer.fit()
    losses = [r["loss"] for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "step"]
    return trainer.session.model, losses


def test_a_split_model_trains_exactly_as_the_unsplit_one(tmp_path):
    reference, ref_losses = _train(tmp_path, "whole")
    placed, losses = _train(tmp_path, "split", place="1=cpu,3=cpu:0")
    assert losses == ref_losses and len(losses) == 4
    assert len(placed[3]._forward_pre_hooks) == 1  # placed: its inputs follow its parameters
    for (name, p), q in zip(placed.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name


@NO_TWO_GPUS
def test_soft_placement_trains_on_the_fallback_and_logs_it(tmp_path, device_log):
    reference, ref_losses = _train(tmp_path, "whole")
    model, losses = _train(tmp_path, "soft", place="3=cuda:1", soft_placement=True)
    warnings = device_log.messages(logging.WARNING)
    assert len(warnings) == 1 and "soft placement: device 'cuda:1' is not available" in warnings[0]
    expected = "cpu" if not torch.cuda.is_available() else "cuda:0"  # one GPU: the index wraps around
    assert str(model[3].weight.device) == expected
    if not torch.cuda.is_available():
        assert losses == ref_losses


@NO_TWO_GPUS
def test_without_soft_placement_the_run_stops_naming_the_available_devices(tmp_path):
    with pytest.raises(DeviceError) as info:
        _train(tmp_path, "strict", place="3=cuda:1")
    assert "device 'cuda:1' is not available" in str(info.value)
    assert "available devices: " + ", ".join(available_device_names()) in str(info.value)


def test_log_placement_writes_the_table_and_the_first_steps_operators(tmp_path, device_log):
    logs = tmp_path / "logs"
    _train(tmp_path, "logged", log_placement=True, log_placement_steps=2, log_dir=str(logs))
    assert sorted(p.name for p in logs.glob("placement*")) == [
        "placement-ops-rank0-step0.txt", "placement-ops-rank0-step1.txt", "placement-rank0.txt"]
    table = (logs / "placement-rank0.txt").read_text()
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]}
    assert rows["1"] == ["Linear", "cpu", "1,040", "4.1", "KiB"]  # 64*16 + 16 float32 parameters
    assert rows["2"] == ["ReLU", "-", "0", "0", "B"]
    ops = (logs / "placement-ops-rank0-step0.txt").read_text()
    rows = [line.split() for line in ops.splitlines() if line.strip()[:1].isdigit()]
    seen = {(row[1], row[-1]) for row in rows if row[-1] == "cpu"}  # (phase, device); backward has a node
    assert {("forward", "cpu"), ("backward", "cpu"), ("loss", "cpu"), ("optimizer", "cpu")} <= seen
    names = {row[2] if row[1] != "backward" else row[3] for row in rows}
    assert {"aten.addmm.default", "aten.relu.default", "aten.mm.default", "aten.threshold_backward.default",
            "aten.add_.Tensor"} <= names
    # the console got the same: the table once, each logged step once
    messages = device_log.messages()
    assert sum(m.startswith("placement of UnitSequential (rank 0)") for m in messages) == 1
    assert sum(m.startswith("operators of step") for m in messages) == 2


def test_a_resumed_run_logs_its_own_first_step(tmp_path):
    common = dict(checkpoint_dir=str(tmp_path / "ckpt"), log_placement=True)
    _train(tmp_path, "first", steps=2, log_dir=str(tmp_path / "a"), **common)
    _train(tmp_path, "resumed", steps=4, resume=True, log_dir=str(tmp_path / "b"), **common)
    assert [p.name for p in (tmp_path / "b").glob("placement-ops-*")] == ["placement-ops-rank0-step2.txt"]
