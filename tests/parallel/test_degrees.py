"""Degrees of one mesh, resolved before launch: each flag one degree, the strategy names standing for common
settings, the class that runs a combination, and what ``polytrain plan`` prints -- all without a process."""

from __future__ import annotations

import logging

import pytest

from polytrain.config import make_config
from polytrain.errors import ConfigError
from polytrain.parallel.degrees import Degrees, deprecated_flags
from polytrain.train.run import check, layout_of


def _layout(**settings):
    return layout_of(make_config(**settings))


@pytest.mark.parametrize("settings, axes, runner", [
    (dict(strategy="sync", workers=4), (("dp_replicate", 4),), "sync"),
    (dict(strategy="fsdp", workers=4), (("dp_replicate", 1), ("dp_shard", 4)), "fsdp"),
    (dict(strategy="fsdp", workers=8, dp_shard=4), (("dp_replicate", 2), ("dp_shard", 4)), "fsdp"),  # HSDP
    (dict(strategy="sync", workers=4, dp_shard=2), (("dp_replicate", 2), ("dp_shard", 2)), "fsdp"),
    (dict(strategy="tp", workers=4), (("dp_replicate", 1), ("tp", 4)), "tp"),
    (dict(strategy="tp", workers=4, tp=2), (("dp_replicate", 2), ("tp", 2)), "tp"),
    (dict(strategy="sync", workers=4, tp=2), (("dp_replicate", 2), ("tp", 2)), "tp"),
    (dict(strategy="pipeline", pp=4), (("dp_replicate", 1), ("pp", 4)), "pipeline"),
    (dict(strategy="pipeline"), (("dp_replicate", 1), ("pp", 2)), "pipeline"),  # two stages by default
    (dict(strategy="hybrid", workers=8, pp=2, tp=2), (("dp_replicate", 2), ("pp", 2), ("tp", 2)), "hybrid"),
    (dict(strategy="hybrid", workers=4, pp=2, dp_shard=2), (("dp_replicate", 1), ("dp_shard", 2), ("pp", 2)),
     "hybrid"),
    (dict(strategy="diloco", workers=3), (("dp_replicate", 3),), "diloco"),
])
def test_a_strategy_name_stands_for_degrees_and_the_class_that_runs_them(settings, axes, runner):
    layout = _layout(**settings)
    assert (layout.axes, layout.strategy) == (axes, runner)
    degrees = Degrees.of(layout.axes)
    assert layout.processes == degrees.world and layout.slices == degrees.dp  # the batch axis: both dp degrees
    assert layout.named == ("" if runner == settings["strategy"] else settings["strategy"])


def test_every_rank_has_its_coordinates_and_the_batch_axis_is_both_dp_degrees():
    layout = _layout(strategy="fsdp", workers=8, dp_replicate=2, tp=2)
    assert [layout.coordinates(r) for r in (0, 3, 5)] == [
        {"dp_replicate": 0, "dp_shard": 0, "tp": 0, "dp": 0},
        {"dp_replicate": 0, "dp_shard": 1, "tp": 1, "dp": 1},
        {"dp_replicate": 1, "dp_shard": 0, "tp": 1, "dp": 2}]
    assert Degrees(2, 2, 1, 2).coordinates(5) == {"dp_replicate": 1, "dp_shard": 0, "pp": 0, "tp": 1}


def test_the_second_names_of_a_degree_still_work_and_say_what_they_are_now():
    assert _layout(strategy="pipeline", stages=4) == _layout(strategy="pipeline", pp=4)
    assert _layout(strategy="hybrid", workers=4, dp=2, pp=2) == _layout(strategy="hybrid", workers=4, dp_replicate=2,
                                                                       pp=2)
    assert _layout(strategy="hybrid", workers=4, dp=2, shard_dp=True).axes == \
        (("dp_replicate", 1), ("dp_shard", 2), ("pp", 2))
    assert deprecated_flags(make_config(strategy="hybrid", stages=2, dp=2, shard_dp=True)) == [
        "--stages 2 is deprecated: it is --pp 2 (one flag per degree); --stages still works for now",
        "--dp 2 --shard-dp is deprecated: it is --dp-shard 2 (one flag per degree); it still works for now"]
    assert deprecated_flags(make_config(strategy="hybrid", pp=2, dp_replicate=2)) == []


@pytest.mark.parametrize("settings, message", [
    (dict(strategy="fsdp", workers=6, tp=4), "^--strategy fsdp: --workers 6 is not a multiple of --tp 4 = 4; pass "
                                             "--workers 4 \\(the rest of --workers becomes --dp-shard\\)$"),
    (dict(strategy="sync", workers=4, dp_replicate=2, dp_shard=4),
     "^--strategy sync: --dp-replicate 2 x --dp-shard 4 = 8 processes, but --workers is 4; pass --workers 8, or "
     "degrees whose product is 4$"),
    (dict(strategy="pipeline", stages=3, pp=2), "^--stages 3 and --pp 2 name the same degree; give --pp only$"),
    (dict(strategy="async", workers=4, tp=2), "^--strategy async with --tp 2: not supported \\(the axes it cuts a "
                                              "replica over: none: each replica whole on one rank\\); drop --tp, or "
                                              "use --strategy sync for the degrees$"),
    (dict(strategy="single", tp=2), "^--strategy single runs one process; --tp 2 lays a model over several: use "
                                    "--strategy sync with it$"),
])
def test_degrees_that_cannot_be_laid_out_are_one_line(settings, message):
    with pytest.raises(ConfigError, match=message):
        check(make_config(**settings))


def test_tp_on_a_model_the_tracer_cuts_is_accepted_before_launch():
    check(make_config(strategy="pipeline", pp=2, tp=2, model="transformer_lm", data="text", split_at="blocks.1.attn"))


def test_a_deprecated_flag_is_one_warning_line_before_the_run(caplog):
    with caplog.at_level(logging.WARNING):
        check(make_config(strategy="pipeline", stages=2, data="digits", model="mlp:hidden=8x8"))
    assert "--stages 2 is deprecated: it is --pp 2" in caplog.text


def test_polytrain_plan_prints_the_degrees_each_ranks_coordinates_and_the_order(capsys):
    from polytrain.cli.main import main

    assert main(["plan", "--strategy", "sync", "--workers", "4", "--dp-shard", "2", "--model", "mlp:hidden=8",
                 "--data", "digits"]) == 0
    shown = capsys.readouterr().out
    assert "layout of --strategy sync (--dp-replicate 2 --dp-shard 2; run by fsdp): 4 process(es)" in shown
    assert "rank 3: trainer worker rank 3  [dp_replicate 1, dp_shard 1]" in shown
    assert "in order: how each replica is made, then how the replicas meet:\n    1. dp_shard 2: fully_shard over dp_shard (HSDP over dp_replicate x dp_shard where both > 1)\n" \
           "    2. 2 replica(s) meet: gradients averaged every step" in shown
