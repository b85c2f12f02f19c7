"""Pipeline schedules and splits are data: printed, checked and compared with torch's, starting no process."""

import json
import re
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from polytrain.errors import ConfigError
from polytrain.models import build_model
from polytrain.parallel.pp import plan, split
from polytrain.parallel.pp.split import check_split, choose_split
from tests.helpers.cli_batch import run_here

SHAPES = [(2, 2), (2, 4), (4, 4), (4, 8), (3, 6)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b"])
@pytest.mark.parametrize("ranks, microbatches", SHAPES)
def test_the_simulated_bubble_is_the_theoretical_one(name, ranks, microbatches):
    """(P-1)/(vM+P-1): fill-drain and 1F1B with v = 1, interleaved with v = 2 chunks per rank."""
    chunks = plan.SCHEDULES[name].chunks
    assert plan.simulate(name, ranks, microbatches).bubble == Fraction(ranks - 1, chunks * microbatches + ranks - 1)


@pytest.mark.parametrize("name", list(plan.SCHEDULES))
@pytest.mark.parametrize("ranks, microbatches", SHAPES)
def test_every_stage_runs_every_microbatch_forward_and_backward_once_on_its_rank(name, ranks, microbatches):
    info = plan.SCHEDULES[name]
    lists = plan.actions(name, ranks, microbatches)
    stages = ranks * info.chunks
    for rank, actions in enumerate(lists):
        assert {plan.stage_rank(a.stage, ranks, info.placement) for a in actions} == {rank}
    done = sorted((a.kind, a.stage, a.microbatch) for rank in lists for a in rank)
    backward = ["B"] if name in ("gpipe", "1f1b", "interleaved-1f1b") else ["I", "W"]
    assert done == sorted((k, s, m) for k in ["F", *backward] for s in range(stages) for m in range(microbatches))
    if backward == ["I", "W"]:  # the zero-bubble schedules beat the 1F1B bound
        assert plan.simulate(name, ranks, microbatches).bubble < plan.theoretical_bubble(ranks, microbatches, 2)


@pytest.mark.parametrize("ranks, microbatches", SHAPES)
def test_the_interleaved_order_is_the_one_torch_runs(ranks, microbatches):
    """ScheduleInterleaved1F1B executes its pipeline_order; ours is the same list per rank, idle slots aside."""
    mine = plan.actions("interleaved-1f1b", ranks, microbatches)
    stand_ins = [SimpleNamespace(group_rank=0, group_size=ranks, num_stages=2 * ranks, submod=None, stage_index=s,
                                 is_first=s == 0, is_last=False) for s in (0, ranks)]
    theirs = torch_schedules.ScheduleInterleaved1F1B(stand_ins, microbatches).pipeline_order
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B"}
    for rank in range(ranks):
        expected = [(kinds[a.computation_type.name], a.stage_index, a.microbatch_index)
                    for a in theirs[rank] if a is not None and a.computation_type.name in kinds]
        assert [tuple(a) for a in mine[rank]] == expected


def test_the_chart_names_each_rank_and_both_bubbles():
    text = plan.chart("gpipe", 2, 2)
    lines = text.splitlines()
    assert lines[2].split() == ["time", "|", "rank", "0", "rank", "1"]
    assert lines[3].split() == ["0", "|", "F0", "."]  # rank 1 waits for the first activation
    assert len(lines) == 3 + 9 + 1  # 3 header lines, (M + P - 1) x (F + B) = 3 x 3 time units, the bubble
    assert lines[-1] == ("bubble: simulated 0.333 (1/3), theoretical (P-1)/(vM+P-1) = 0.333 (1/3)")


def test_polytrain_plan_prints_without_starting_anything(capsys):
    # the command's main in this process: no helper process of multiprocessing is started by it either
    from polytrain.distributed.mp_helpers import helper_processes

    before = helper_processes()
    out = run_here(capsys, "plan", "--strategy", "pipeline", "--pp", "4", "--microbatches", "8", "--schedule",
                   "interleaved-1f1b", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)["pipeline"]
    assert data["bubble_simulated"] == data["bubble_theoretical"] == pytest.approx(3 / 19)
    assert data["actions"][0][:2] == ["F0s0", "F1s0"]
    bad = run_here(capsys, "plan", "--strategy", "pipeline", "--pp", "4", "--microbatches", "2", "--schedule", "1f1b")
    assert helper_processes() == before
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "1f1b needs --microbatches >= --stages" in bad.stderr


def test_limits_and_a_schedule_this_torch_lacks_are_one_line_each(monkeypatch):
    with pytest.raises(ConfigError, match="1f1b needs --microbatches >= --stages"):
        plan.check_schedule("1f1b", 4, 3)
    with pytest.raises(ConfigError, match="below --stages or a multiple"):
        plan.check_schedule("interleaved-1f1b", 4, 9)
    with pytest.raises(ConfigError, match="unknown schedule"):
        plan.check_schedule("pipedream", 2, 2)
    # a schedule named in the table whose class the installed torch does not have
    future = plan.ScheduleInfo("future", "ScheduleFromTheFuture", 1, "loop", "")
    monkeypatch.setitem(plan.SCHEDULES, "future", future)
    lacks = rf"installed torch {re.escape(torch.__version__)} has no .*ScheduleFromTheFuture"
    with pytest.raises(ConfigError, match=lacks):
        plan.check_schedule("future", 2, 2)


def test_balanced_cuts_minimise_the_slowest_stage():
    assert split.balanced_cuts([1, 1, 1, 1], 2) == [2]
    assert split.balanced_cuts([5, 1, 1, 1, 1, 1], 2) == [1]
    assert split.balanced_cuts([1, 2, 3, 4, 5, 6], 3) == [3, 5]  # 6 | 4+5 | 6 -> max 9 is the best possible
    assert split.groups([1, 3], 4) == [range(0, 1), range(1, 3), range(3, 4)]


def test_transformer_lm_units_and_split_errors():
    model = build_model("transformer_lm:layers=4,dim=32,heads=2", input_shape=(16,), num_classes=50)
    names = check_split(model, 2, "blocks.2")
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    with pytest.raises(ConfigError, match="--split-at blocks.9: no such unit; the model's units are embed, blocks.0"):
        check_split(model, 2, "blocks.9")
    with pytest.raises(ConfigError, match="8 stages but the model has only 6 splittable units"):
        check_split(model, 8, "auto")
    with pytest.raises(ConfigError, match="4 stages need 3 split point"):
        check_split(model, 4, "blocks.1")
    with pytest.raises(ConfigError, match=r"^--split-at blocks.2,blocks.1: split points must be increasing and "
                                          r"after the first unit \(embed\)$"):
        check_split(model, 3, "blocks.2,blocks.1")
    with pytest.raises(ConfigError, match=r"^--split-at embed: split points must be increasing"):
        check_split(model, 2, "embed")


def test_a_model_with_tensors_of_its_own_is_refused():
    class Scaled(nn.Sequential):
        def __init__(self):
            super().__init__(nn.Linear(4, 4), nn.Linear(4, 2))
            self.scale = nn.Parameter(torch.ones(1))

    with pytest.raises(ConfigError, match=r"^the model holds tensors outside its units \(scale\); a pipeline splits "
                                          "only models whose forward is their children in order$"):
        check_split(Scaled(), 2, "auto")


def test_one_stage_and_no_microbatch_are_one_line(capsys):
    from polytrain.cli.main import main

    with pytest.raises(ConfigError, match="^--stages 1: a pipeline needs at least 2 stages$"):
        plan.check_schedule("gpipe", 1, 2)
    assert main(["plan", "--strategy", "pipeline", "--stages", "2", "--microbatches", "0"]) == 2
    assert capsys.readouterr().err == "polytrain: error: --microbatches: must be >= 1, got 0\n"


def test_a_measured_split_is_printed_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.BatchNorm1d(64), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    chosen = choose_split(model, torch.randn(16, 8), 2, "auto")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too
    assert all(p.grad is None for p in model.parameters())
    text = chosen.describe([0, 1])
    assert text.splitlines()[1].startswith("  stage 0 (rank 0): 0 ") and "parameters" in text and " ms" in text
    assert chosen.how == "measured" and len(chosen.cuts) == 1


def test_a_model_whose_forward_is_not_its_children_in_order_is_refused():
    class Skips(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.b(x) + self.a(x)

    with pytest.raises(ConfigError, match="forward is not its units applied in order"):
        choose_split(Skips(), torch.randn(2, 4), 2, "auto")
