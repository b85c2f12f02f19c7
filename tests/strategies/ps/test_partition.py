import math
import random

import pytest
import torch

from polytrain.errors import ConfigError
from polytrain.strategies.ps.partition import PartitionPlan


def random_specs(rng: random.Random, count: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = [tuple(rng.randint(1, 40) for _ in range(rng.randint(0, 3))) for _ in range(count)]
    return [(f"t{i}", shape) for i, shape in enumerate(shapes)]


@pytest.mark.parametrize("seed", range(40))
def test_balance_bound_and_every_element_once(seed):
    rng = random.Random(seed)
    specs = random_specs(rng, rng.randint(1, 12))
    servers = rng.randint(1, 5)
    min_split = rng.choice([1, 50, 500, 10**9])
    plan = PartitionPlan.build(specs, servers, min_split=min_split)
    plan.check()
    capacity = math.ceil(plan.total / servers)
    unsplittable = max([t.numel for t in plan.tensors if t.numel < min_split], default=0)
    assert sum(plan.loads()) == plan.total
    assert max(plan.loads()) <= capacity + max(0, unsplittable - 1)
    if min_split == 1:
        assert max(plan.loads()) <= capacity


def test_a_large_tensor_is_split_and_small_ones_are_not():
    plan = PartitionPlan.build([("w1", (40, 10)), ("b1", (10,)), ("w2", (3, 10)), ("b2", (3,))], 2, min_split=100)
    assert plan.split_tensors() == ["w1"]
    assert plan.loads() == [222, 221]
    assert [(p.name, p.server, p.start, p.stop) for p in plan.pieces] == [
        ("w1", 0, 0, 222), ("w1", 1, 222, 400), ("b1", 1, 0, 10), ("w2", 1, 0, 30), ("b2", 1, 0, 3)]


def test_describe_names_every_server_and_split():
    plan = PartitionPlan.build([("w", (4, 5)), ("b", (5,))], 2, min_split=1)
    text = plan.describe()
    assert text.splitlines()[0] == "25 parameters over 2 server(s), ideal 13 each"
    assert "server 0: 13 (w [4x5] elements 0:13)" in text
    assert "server 1: 12 (w [4x5] elements 13:20, b [5])" in text


def test_more_servers_than_elements_leaves_some_empty():
    plan = PartitionPlan.build([("b", (2,))], 4, min_split=1)
    plan.check()
    assert plan.loads() == [1, 1, 0, 0]
    assert "server 3: 0 (nothing)" in plan.describe()


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_flatten_unflatten_round_trip(servers):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.Linear(9, 2))
    named = dict(model.named_parameters())
    plan = PartitionPlan.for_model(named.items(), servers, min_split=1)
    flats = [plan.flatten(named, s) for s in range(servers)]
    assert [f.numel() for f in flats] == plan.loads()
    assert torch.equal(torch.cat(flats), torch.cat([p.detach().reshape(-1) for p in named.values()]))
    copy = {name: torch.zeros_like(p) for name, p in named.items()}
    for s, flat in enumerate(flats):
        plan.unflatten(flat, s, copy)
    for name, p in named.items():
        assert torch.equal(copy[name], p.detach())


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="--servers must be >= 1, got 0"):
        PartitionPlan.build([("w", (2,))], 0)
    with pytest.raises(ConfigError, match="^parameter names must be unique to partition them across servers$"):
        PartitionPlan.build([("w", (2,)), ("w", (3,))], 1)
