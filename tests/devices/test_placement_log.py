"""The placement log: the module table and the per-operator device log of one training step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.devices.placement import place
from polytrain.devices.placement_log import OpDeviceLog, PlacementLogger, log_placement, module_table
from tests.devices.helpers import make_net


def _row(table: str, path: str) -> list[str]:
    return next(line.split() for line in table.splitlines() if line.split()[0] == path)


def test_module_table_counts_parameters_and_bytes():
    table = module_table(make_net())
    assert table.splitlines()[0].split() == ["MODULE", "TYPE", "DEVICE", "PARAMS", "BYTES"]
    assert _row(table, "(model)") == ["(model)", "Net", "cpu", "67", "268", "B"]
    assert _row(table, "features") == ["features", "Sequential", "cpu", "40", "160", "B"]
    assert _row(table, "features.0") == ["features.0", "Linear", "cpu", "40", "160", "B"]
    assert _row(table, "features.1") == ["features.1", "ReLU", "-", "0", "0", "B"]
    assert _row(table, "classifier.0") == ["classifier.0", "Linear", "cpu", "27", "108", "B"]


def test_module_table_shows_each_device_and_counts_buffers_as_bytes_only():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    place(model, {"1": torch.device("meta")})
    table = module_table(model)
    # BatchNorm1d(2): 4 parameter values, buffers running_mean(2) + running_var(2) float + num_batches (int64)
    assert _row(table, "1") == ["1", "BatchNorm1d", "meta", "4", "40", "B"]
    assert _row(table, "(model)")[:4] == ["(model)", "Sequential", "cpu,meta", "10"]


def _mlp_step(model: nn.Module, oplog: OpDeviceLog) -> None:
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with oplog:
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        with oplog.phase("optimizer"):
            optimizer.step()


def test_per_op_log_of_an_mlp_step_names_the_aten_ops_and_their_device():
    oplog = OpDeviceLog()
    _mlp_step(make_net(), oplog)
    by_phase: dict[str, set[str]] = {}
    for record in oplog.records:
        by_phase.setdefault(record.phase.split(" ")[0], set()).add(record.op)
    assert {"aten.addmm.default", "aten.relu.default", "aten._log_softmax.default"} <= by_phase["forward"]
    assert {"aten.mm.default", "aten.threshold_backward.default",
            "aten._log_softmax_backward_data.default"} <= by_phase["backward"]
    assert "aten.add_.Tensor" in by_phase["optimizer"]
    assert {r.device for r in oplog.records} == {"cpu"}
    assert any(r.phase == "backward (AddmmBackward0)" for r in oplog.records)
    text = oplog.format()
    assert "aten.addmm.default" in text and "summary" in text
    assert f"({len(oplog.records)} operator calls)" in text


def test_per_op_log_shows_copies_between_devices(lazy):
    # forward only: the lazy backend cannot run its backward under a Python dispatch mode
    model = place(make_net(), {"classifier": lazy})
    oplog = OpDeviceLog()
    with oplog:
        model(torch.randn(2, 4))
    assert [r.where() for r in oplog.records if r.op == "aten._to_copy.default"] == ["cpu -> lazy:0"]
    assert [r.device for r in oplog.records if r.op == "aten.addmm.default"] == ["cpu", "lazy:0"]


def test_per_op_log_is_bounded():
    oplog = OpDeviceLog(max_ops=5)
    _mlp_step(make_net(), oplog)
    assert len(oplog.records) == 5 and oplog.dropped > 0
    assert [r.index for r in oplog.records] == [1, 2, 3, 4, 5]
    assert f"{oplog.dropped} more not recorded (max_ops=5)" in oplog.format()
    with pytest.raises(ValueError):
        OpDeviceLog(max_ops=-1)


def test_write(tmp_path):
    oplog = OpDeviceLog()
    _mlp_step(make_net(), oplog)
    path = oplog.write(tmp_path / "sub" / "ops.txt")
    assert path.read_text() == oplog.format() + "\n"


def test_step_context_logs_the_first_step_only(tmp_path, captured):
    logger, handler = captured
    placement = PlacementLogger(rank=1, log_dir=tmp_path, logger=logger)
    model = make_net()
    for step in range(3):
        with placement.step_context(step) as oplog:
            assert (oplog is not None) == (step == 0)
            model(torch.randn(2, 4)).sum().backward()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["placement-ops-rank1-step0.txt"]
    assert "operators of step 0 and their devices (rank 1)" in handler.messages()[0]
    assert "aten.addmm.default" in (tmp_path / files[0]).read_text()


def test_a_failing_step_still_writes_its_log(tmp_path, captured):
    logger, _ = captured
    placement = PlacementLogger(log_dir=tmp_path, logger=logger, steps=[2])
    with pytest.raises(RuntimeError):
        with placement.step_context(2):
            torch.ones(2) @ torch.ones(3)
    text = (tmp_path / "placement-ops-rank0-step2.txt").read_text()
    assert "aten.dot.default" in text and "failed: RuntimeError" in text


def test_log_placement_prints_and_saves_the_table(tmp_path, captured):
    logger, handler = captured
    text = log_placement(make_net(), rank=3, log_dir=tmp_path, logger=logger)
    assert text.startswith("placement of Net (rank 3)\nMODULE")
    assert (tmp_path / "placement-rank3.txt").read_text() == text + "\n"
    assert handler.messages() == [text]
