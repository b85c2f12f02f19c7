"""Strategies are chosen by name or as package.module:Class; a name is taken once."""

import pytest

from polytrain.errors import ConfigError
from polytrain.strategies import Strategy, available_strategies, get_strategy, register_strategy


def test_a_name_is_taken_once():
    class Impostor(Strategy):
        name = "sync"

    with pytest.raises(ValueError, match="strategy name 'sync' is taken by polytrain.strategies.sync"):
        register_strategy(Impostor)
    assert get_strategy("sync").__name__ == "SyncDataParallel"


def test_a_strategy_class_is_found_by_its_import_path():
    found = get_strategy("tests.strategies.test_protocol:TwoStages")
    assert found.name == "test-two-stages" and issubclass(found, Strategy)
    with pytest.raises(ConfigError, match="not a polytrain.Strategy subclass"):
        get_strategy("polytrain.errors:ConfigError")
    with pytest.raises(ConfigError, match="cannot import it"):
        get_strategy("no_such_module:Thing")


def test_an_unknown_name_lists_the_registered_ones():
    with pytest.raises(ConfigError, match="did you mean 'sync'.*available: " + ", ".join(available_strategies())):
        get_strategy("synk")


def test_train_help_lists_the_registered_strategies():
    from polytrain.cli.main import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "parallel strategy: " + " | ".join(available_strategies()) in " ".join(text.split())


def test_batches_that_do_not_cut_evenly_are_one_line():
    import torch
    from torch.utils.data import TensorDataset

    from polytrain.config import make_config
    from polytrain.distributed.topology import Topology
    from polytrain.train.run import check

    with pytest.raises(ConfigError, match=r"^each worker's batch \(5\) must be divisible by --accumulate \(3\)$"):
        check(make_config(strategy="sync", workers=2, data="digits", batch_size=10, accumulate=3))
    # an own loop's batches: rank 0 of 2 (the check comes before any collective)
    from polytrain.api import OwnLoop

    sync = OwnLoop(get_strategy("sync")(Topology(rank=0, world_size=2), None))
    data = TensorDataset(torch.zeros(10, 2), torch.zeros(10))
    with pytest.raises(ConfigError, match="^batch size 5 does not divide over 2 workers$"):
        next(iter(sync.batches(data, batch_size=5)))
