"""Optimizer state between servers' pieces and single's layout, staleness numbers, and the book's clock
rules for reads and resumes: all without processes."""

import pytest
import torch
from torch import nn

from polytrain.errors import ConfigError
from polytrain.strategies.ps import PartitionPlan, ServerBook, StalenessPolicy
from polytrain.strategies.ps.state import StateFormat
from polytrain.strategies.ps.stats import StalenessWindow, staleness_summary


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 5))


def _stepped(model: nn.Module, make) -> torch.optim.Optimizer:
    optimizer = make(model.parameters())
    for seed in range(3):
        model.zero_grad()
        model(torch.randn(4, 40, generator=torch.Generator().manual_seed(seed))).square().sum().backward()
        optimizer.step()
    return optimizer


def _server_optimizers(plan, make, layout, per_server):
    """What each server would hold after loading ``per_server`` (1-D pieces, as ParameterServer builds them)."""
    out = []
    for s in range(plan.servers):
        params = [nn.Parameter(torch.zeros(p.numel)) for p in plan.pieces_of(s)]
        optimizer = make(params)
        layout.unpack(optimizer, params, per_server[s])
        out.append((optimizer, params))
    return out


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, amsgrad=True),
], ids=["sgd-momentum", "adam", "adamw-amsgrad"])
def test_single_state_goes_to_split_servers_and_comes_back_equal(make):
    model = _model()
    optimizer = _stepped(model, make)
    layout = StateFormat.probe(make)
    plan = PartitionPlan.for_model(model.named_parameters(), 3, min_split=64)  # the 40x30 weight is cut
    assert plan.split_tensors()
    params = dict(model.named_parameters())
    per_server = layout.from_single(plan, optimizer.state_dict()["state"], params)
    servers = _server_optimizers(plan, make, layout, per_server)
    back = layout.to_single(plan, [layout.pack(o, ps) for o, ps in servers], params)
    expected = optimizer.state_dict()["state"]
    assert back.keys() == expected.keys()
    for index, state in expected.items():
        assert back[index].keys() == state.keys()
        for key, value in state.items():
            torch.testing.assert_close(back[index][key], value, rtol=0, atol=0)


def test_plain_sgd_keeps_no_state_and_a_server_before_its_first_update_has_none():
    layout = StateFormat.probe(lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert layout.empty
    adam = StateFormat.probe(lambda ps: torch.optim.Adam(ps))
    param = nn.Parameter(torch.zeros(3))
    assert adam.pack(torch.optim.Adam([param]), [param]) is None
    plan = PartitionPlan.for_model(_model().named_parameters(), 2)
    assert adam.to_single(plan, [None, None], dict(_model().named_parameters())) == {}


def test_a_checkpoint_missing_some_parameters_state_is_refused():
    make = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    model = _model()
    state = _stepped(model, make).state_dict()["state"]
    del state[2]
    plan = PartitionPlan.for_model(model.named_parameters(), 2)
    with pytest.raises(ConfigError, match=r"lacks parameter\(s\) 2.weight; async restores the state of every"):
        StateFormat.probe(make).from_single(plan, state, dict(model.named_parameters()))


def test_staleness_of_a_gradient_is_the_most_any_server_saw():
    # rows: worker, clock, ticket, read version, applied version, missed
    server0 = torch.tensor([[0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 1, 1], [0, 1, 2, 1, 1, 0]])
    server1 = torch.tensor([[0, 0, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [0, 1, 2, 0, 2, 1]])
    out = staleness_summary([server0, server1], duplicates=1, bound=None)
    assert out["staleness_histogram"] == {"0": 1, "1": 1, "2": 1}
    assert out["staleness_max"] == 2 and out["staleness_mean"] == 1.0 and out["gradients_applied"] == 3
    assert out["slices_per_worker"] == [2, 1]
    assert out["duplicate_pushes_ignored"] == 1
    window = StalenessWindow()
    for value in (-1, 0, 2, 1):
        window.add(value)
    assert window.take() == {"staleness_max": 2, "staleness_mean": 1.0} and window.take() == {}


def test_a_read_waits_for_every_earlier_step_and_a_resume_starts_every_clock_later():
    book = ServerBook([0, 1], StalenessPolicy(None))
    assert book.caught_up(0) and not book.caught_up(1)
    book.applied(0, 0, 0)
    assert not book.caught_up(1)
    book.applied(1, 0, 0)
    assert book.caught_up(1) and not book.caught_up(2)
    book.applied(0, 1, 1)
    assert not book.caught_up(2)  # worker 1's slice of step 1 is still out
    book.applied(1, 1, 1)
    assert book.caught_up(2)
    resumed = ServerBook([0, 1], StalenessPolicy(0))
    resumed.start_at(8)
    assert resumed.version() == 8 and resumed.caught_up(8) and resumed.admit(0, 8) == 16 and resumed.admit(0, 7) is None


class _Counting(torch.optim.SGD):
    """An optimizer whose state holds a plain Python number, as some third-party ones do."""

    def step(self, closure=None):
        super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1


def test_an_optimizer_state_that_is_not_tensors_is_refused():
    with pytest.raises(ConfigError, match=r"^--strategy async: the optimizer's state 'count' \(int\) cannot be kept on "
                                          r"parameter servers; use one of --optimizer's choices \(sgd, adam, "
                                          r"adamw, rmsprop, adagrad\)$"):
        StateFormat.probe(lambda ps: _Counting(ps, lr=0.1))
