import pytest

from polytrain.errors import ConfigError
from polytrain.strategies.ps.ranks import Ranks


def test_workers_come_first_then_servers():
    layout = Ranks(workers=3, servers=2)
    assert layout.world_size == 5
    assert layout.worker_ranks == [0, 1, 2] and layout.server_ranks == [3, 4]
    assert [layout.role(r) for r in range(5)] == ["trainer"] * 3 + ["server"] * 2
    assert layout.server_index(4) == 1
    assert layout.name(1) == "worker rank 1" and layout.name(3) == "parameter server rank 3"


def test_bad_counts_are_one_line_errors():
    with pytest.raises(ConfigError, match="--servers must be >= 1, got 0"):
        Ranks(2, 0)
    with pytest.raises(ConfigError, match="--workers must be >= 1, got 0"):
        Ranks(0, 1)
