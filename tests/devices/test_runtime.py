"""DeviceRuntime: what the trainer calls to place a model, log it and wrap each step."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from polytrain.devices.runtime import DeviceRuntime
from tests.devices.helpers import make_net


def test_prepare_places_and_logs_the_model(tmp_path, captured):
    logger, handler = captured
    runtime = DeviceRuntime(log_placement=True, rank=2, log_dir=tmp_path, logger=logger, gpu_memory_fraction=0.5)
    model = runtime.prepare(make_net(), {"classifier": torch.device("meta")})
    assert model.classifier[0].weight.device.type == "meta"
    table = (tmp_path / "placement-rank2.txt").read_text()
    assert "classifier.0  Linear      meta" in table
    messages = handler.messages()
    assert messages[0] == "placement: classifier -> meta"
    assert any("no effect on cpu" in m for m in messages) and any("no effect on meta" in m for m in messages)


def test_soft_runtime_keeps_one_mode_across_steps():
    runtime = DeviceRuntime(soft=True)
    for step in range(2):
        with runtime.step_context(step):
            assert _get_current_dispatch_mode_stack() == [runtime.soft_mode]
    assert _get_current_dispatch_mode_stack() == []


def test_step_context_logs_the_chosen_steps_only(tmp_path, captured):
    logger, _ = captured
    runtime = DeviceRuntime(log_placement=True, log_dir=tmp_path, logger=logger, log_steps=(1,))
    model = runtime.prepare(make_net())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        with runtime.step_context(step):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(2, 4)), torch.tensor([0, 1])).backward()
            with runtime.phase("optimizer"):
                optimizer.step()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement-ops-rank0-step1.txt", "placement-rank0.txt"]
    phases = {r.phase.split(" ")[0] for r in runtime.placement_logger.last.records}
    assert phases == {"forward", "backward", "optimizer"}


def test_without_options_the_step_context_adds_no_mode():
    runtime = DeviceRuntime()
    with runtime.step_context(0):
        assert _get_current_dispatch_mode_stack() == []  # no Python dispatch cost on plain runs
