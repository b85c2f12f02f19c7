"""Memory measured in a run (polytrain/train/memory.py): what autograd saves for backward, the bytes of a rank's
parameters, gradients and optimizer state, and the peak, in the summary and the end record."""

import json

import torch
from torch import nn

import polytrain
from polytrain.cli.train import format_summary
from polytrain.train.memory import MemoryMeter, SavedTensors, peak_bytes, state_bytes


def test_saved_tensors_counts_what_backward_keeps_each_storage_once_and_no_parameter():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    counter = SavedTensors()
    with counter.hooks():
        loss = model(x).sum()
    # the first linear keeps its input (3x4 floats), ReLU its output (3x8), which the second linear keeps too:
    # one storage; the weights (and their transposes) are parameters, not activations
    assert counter.peak == counter.current == (3 * 4 + 3 * 8) * 4
    loss.backward()
    assert counter.current == 0 and counter.peak == 144
    assert model[0].weight.grad is not None  # the hooks give autograd what it saved


def test_saved_tensors_peak_is_the_most_held_at_once():
    layer = nn.Linear(16, 16)
    counter = SavedTensors()
    with counter.hooks():
        for _ in range(3):  # three micro-batches one after another: each freed by its backward
            layer(torch.randn(5, 16)).relu().sum().backward()
    assert counter.current == 0
    assert counter.peak == 2 * 5 * 16 * 4  # the input and the ReLU's output of one micro-batch


def test_state_bytes_counts_parameters_gradients_and_optimizer_state_by_storage():
    model = nn.Sequential(nn.Linear(10, 5), nn.BatchNorm1d(5))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    optimizer.step()
    params = (10 * 5 + 5 + 5 + 5) * 4  # linear weight and bias, batch norm weight and bias
    buffers = 5 * 4 * 2 + 8  # running mean and variance, num_batches_tracked (int64)
    state = state_bytes(model, [optimizer])
    assert state.parameters == params + buffers
    assert state.gradients == params
    assert state.optimizer == 2 * params + 4 * 4  # exp_avg, exp_avg_sq, and a 4-byte step per parameter tensor
    assert state.total == state.parameters + state.gradients + state.optimizer


def test_state_bytes_counts_emptied_tensors_as_nothing_and_shared_storage_once():
    model = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    model[1].weight = model[0].weight  # tied: one storage
    assert state_bytes(model).parameters == 36 * 4
    model[0].weight.data = torch.empty(0)  # a pipeline rank empties the stages it does not hold
    assert state_bytes(model).parameters == 0
    view_holder = nn.Module()
    base = torch.zeros(100)
    view_holder.a, view_holder.b = nn.Parameter(base[:50]), nn.Parameter(base[50:])  # views of one storage
    assert state_bytes(view_holder).parameters == 100 * 4


def test_the_copies_a_strategy_keeps_count_as_optimizer_state_once():
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    anchor = torch.zeros(4)  # (diloco's anchor: not the model's parameters, kept besides them)
    assert state_bytes(nn.Linear(1, 1), [optimizer], kept=[anchor, anchor[:2]]).optimizer == (3 + 4) * 4


def test_the_meter_measures_the_steps_after_the_first():
    meter = MemoryMeter("cpu", measured_steps=3)
    layer = nn.Linear(8, 8)
    for batch in (100, 5, 7, 1000):  # the first (one-time work) and the fourth (past the measured steps) left out
        with meter.step():
            layer(torch.randn(batch, 8)).relu().sum().backward()
    assert meter.activations == 2 * 7 * 8 * 4
    assert peak_bytes(torch.device("cpu")) > 0
    lone = MemoryMeter("cpu")
    with lone.step():
        layer(torch.randn(2, 8)).relu().sum().backward()
    assert lone.activations == 2 * 2 * 8 * 4  # a run of one step: its only step


def test_a_run_reports_each_ranks_memory_in_the_summary_and_the_end_record(tmp_path):
    metrics = tmp_path / "m.jsonl"
    summary = polytrain.fit(strategy="single", model="mlp:hidden=32", data="digits", steps=4, batch_size=16,
                            optimizer="adam", progress="off", metrics_file=str(metrics), seed=1)
    end = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert end["event"] == "end"
    for record in (summary, end):
        assert record["memory_measure"] == "peak RSS"
        assert record["peak_memory_mb"] == max(record["rank_peak_memory_mb"]) > 50  # the process: torch and all
        (rank,) = record["rank_memory_bytes"]
        params = (64 * 32 + 32 + 32 * 10 + 10) * 4  # digits: 8x8 inputs, 10 classes
        assert (rank["parameters"], rank["gradients"]) == (params, params)
        assert rank["optimizer"] == 2 * params + 4 * 4
        assert record["rank_state_mb"] == [round(4 * params / 2**20 + 16 / 2**20, 2)]
        assert rank["activations"] > 16 * 64 * 4  # at least each example's input
    line = format_summary({**summary, "wall_s": 1.0}).splitlines()[-1]
    assert line.startswith("  memory per rank: peak ") and "(peak RSS)" in line and "activations" in line
