"""The step's meters: the losses kept and checked at log points, the steady rate apart from the warm-up."""

import math

import pytest
import torch

from polytrain.train import metrics
from polytrain.train.loggers import clock
from polytrain.train.metrics import DivergenceGuard, StepMeter


@pytest.mark.parametrize("fold_every", [3, 1000])  # folded between reads, or only when read
def test_the_first_bad_loss_is_found_whatever_the_folds(monkeypatch, fold_every):
    monkeypatch.setattr(metrics, "FOLD_EVERY", fold_every)
    guard = DivergenceGuard(torch.device("cpu"))
    for step in range(1, 8):
        guard.observe(torch.tensor(1.0), step)
    assert guard.first_bad() is None and guard.take_mean() == 1.0
    values = {8: 2.0, 9: math.inf, 10: 3.0, 11: math.nan, 12: 4.0}
    for step, value in values.items():
        guard.observe(torch.tensor(value), step)
    assert guard.first_bad() == (9, math.inf)  # the first one, not the NaN after it
    assert math.isnan(guard.take_mean())
    guard.observe(torch.tensor(1.0), 13)
    assert guard.take_mean() == 1.0 and guard.first_bad() == (9, math.inf)


def test_a_read_before_the_log_point_keeps_the_interval_whole():
    guard = DivergenceGuard(torch.device("cpu"))
    guard.observe(torch.tensor(1.0), 1)
    guard.observe(None, 2)  # a rank without a loss keeps nothing
    assert guard.first_bad() is None  # (before an evaluation or a checkpoint)
    guard.observe(torch.tensor(3.0), 3)
    guard.observe(torch.tensor(5.0, dtype=torch.float64), 4)  # another dtype is read as float32
    assert guard.take_mean() == 3.0 and guard.take_mean() is None


def test_the_steady_rate_leaves_the_warm_up_out():
    meter = StepMeter(window=2, warmup=2)
    for seconds in (5.0, 3.0):  # the warm-up: slow first steps
        meter.add(10, seconds, 0.0)
    assert meter.window_steps_per_sec() is None and meter.steady_steps_per_sec() == 2 / 8.0
    for seconds, waited in ((1.0, 0.5), (0.5, 0.0), (0.5, 0.0)):
        meter.add(10, seconds, waited)
    assert meter.warmup_steps == 2 and meter.warmup_s == 8.0 and meter.warmup_steps_per_sec() == 0.25
    assert meter.steady_steps_per_sec() == 3 / 2.0
    assert meter.window_steps_per_sec() == 2 / 1.0  # the latest two
    assert meter.steady_busy_examples_per_sec() == 30 / 1.5  # less the half second waited for others
    interval = meter.take_interval()
    assert (interval.steps, interval.examples, interval.wall_s) == (5, 50, 10.0)
    assert meter.take_interval().steps == 0
    assert meter.seconds_left(0, 0.0) == 0.0 and meter.seconds_left(10, 0.0) > 0


def test_the_progress_line_clock():
    assert [clock(s) for s in (None, 0.4, 7, 754.2, 3723)] == ["?", "0:00", "0:07", "12:34", "1:02:03"]
