"""Layouts are data: every strategy's, for the settings it reads, computed and printed without a process."""

from __future__ import annotations

import json

import pytest

import polytrain
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.strategies import get_strategy
from polytrain.strategies.base import layout_for
from polytrain.train.run import layout_of
from tests.helpers.cli_batch import run_here


def _layout(**settings) -> Layout:
    return layout_of(polytrain.make_config(**settings))


def test_data_parallel_strategies_lay_out_one_replica_per_worker():
    for name in ("sync", "local-sgd", "diloco"):
        layout = _layout(strategy=name, workers=3)
        assert layout.processes == 3 and layout.roles == ("trainer",) * 3
        assert layout.axes == (("dp_replicate", 3),) and layout.slices == 3 and layout.expendable == ()
    assert _layout(strategy="sync").processes == 2  # --workers' default
    assert _layout(strategy="single", workers=4).processes == 1  # single runs in the launching process
    assert _layout(strategy="local-sgd", sync_every=4).meets_every == 4
    assert _layout(strategy="sync", device="cpu:3").processes == 3  # the device spec names the workers


def test_async_lays_out_workers_then_servers_and_its_helpers():
    layout = _layout(strategy="async", workers=3, servers=2)
    assert layout.roles == ("trainer",) * 3 + ("server",) * 2
    assert layout.names[3] == "parameter server rank 3" and layout.name(0) == "worker rank 0"
    assert layout.axes == (("dp_replicate", 3),) and layout.slices == 3 and layout.meets_every == 0
    tolerant = _layout(strategy="async", workers=3, tolerate_worker_loss=True)
    assert tolerant.roles == ("trainer", "helper", "helper", "server")
    assert tolerant.expendable == (1, 2) and tolerant.axes == (("dp_replicate", 1),) and tolerant.slices == 3


def test_pipeline_and_hybrid_lay_out_a_mesh_the_settings_say():
    pipeline = _layout(strategy="pipeline", pp=4, workers=7)  # --workers is not read: the stages are
    assert pipeline.processes == 4 and pipeline.axes == (("dp_replicate", 1), ("pp", 4)) and pipeline.slices == 1
    assert _layout(strategy="pipeline", stages=4) == pipeline  # --stages: the deprecated name of --pp
    hybrid = _layout(strategy="hybrid", dp_replicate=2, pp=2)  # no --workers: dp x pp
    assert hybrid.processes == 4 and hybrid.axes == (("dp_replicate", 2), ("pp", 2)) and hybrid.slices == 2
    assert _layout(strategy="hybrid", dp=2, pp=2) == hybrid  # --dp: the deprecated name of --dp-replicate
    assert _layout(strategy="hybrid", workers=6, pp=3).axes == (("dp_replicate", 2), ("pp", 3))
    with pytest.raises(ConfigError, match="--dp-replicate 2 x --pp 2 = 4 processes, but --workers is 6"):
        _layout(strategy="hybrid", workers=6, dp=2, pp=2)
    with pytest.raises(ConfigError, match="^--stages 3 and --pp 2 name the same degree; give --pp only$"):
        _layout(strategy="pipeline", stages=3, pp=2)


def test_a_layout_for_a_process_count_is_the_one_that_fills_it():
    assert layout_for(get_strategy("async"), 4).roles == ("trainer",) * 3 + ("server",)
    assert layout_for(get_strategy("hybrid"), 4).axes == (("dp_replicate", 2), ("pp", 2))
    with pytest.raises(ConfigError, match="cannot lay out 3 process"):
        layout_for(get_strategy("pipeline"), 3)


def test_a_layout_prints_each_rank_its_role_and_coordinates():
    text = _layout(strategy="hybrid", dp_replicate=2, pp=2).describe()
    assert "--strategy hybrid (--dp-replicate 2 --pp 2): 4 process(es)" in text and "dp_replicate 2 x pp 2" in text
    assert "rank 3: trainer worker rank 3  [dp_replicate 1, pp 1]" in text
    text = _layout(strategy="async", workers=2, tolerate_worker_loss=True).describe()
    assert "rank 1: helper  worker rank 1  (may be lost: the job goes on without it)" in text
    assert "rank 2: server  parameter server rank 2" in text


def test_a_layout_checks_itself():
    with pytest.raises(ValueError, match="hold 4 ranks, but 2 train"):
        Layout("x", ("trainer", "trainer"), (("dp", 4),), 4)
    with pytest.raises(ValueError, match="roles must be"):
        Layout("x", ("boss",), (("dp", 1),), 1)
    with pytest.raises(ValueError, match="expendable ranks"):
        Layout("x", ("trainer", "trainer"), (("dp", 2),), 2, expendable=(2,))


@pytest.mark.parametrize("args, expected", [
    (["--strategy", "async", "--workers", "3", "--servers", "2"],
     {"processes": 5, "roles": ["trainer"] * 3 + ["server"] * 2, "axes": {"dp_replicate": 3}}),
    (["--strategy", "hybrid", "--workers", "4", "--pp", "2"],
     {"processes": 4, "roles": ["trainer"] * 4, "axes": {"dp_replicate": 2, "pp": 2}}),
])
def test_polytrain_plan_prints_any_strategys_layout(capsys, args, expected):
    """The command's main in this process: plan starts no process."""
    out = run_here(capsys, "plan", *args, "--json")
    assert out.returncode == 0, out.stderr
    layout = json.loads(out.stdout)["layout"]
    assert {key: layout[key] for key in expected} == expected
    text = run_here(capsys, "plan", *args)
    assert text.returncode == 0 and f"{expected['processes']} process(es)" in text.stdout


def test_a_strategy_refuses_a_layout_of_another_size():
    from polytrain.distributed.topology import Topology

    with pytest.raises(ConfigError, match="^--strategy sync lays out 3 process\\(es\\); this job has 2$"):
        get_strategy("sync")(Topology(rank=0, world_size=2), None, Layout.data_parallel("sync", 3))
