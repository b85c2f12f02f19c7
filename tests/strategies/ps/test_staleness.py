import itertools

import pytest

from polytrain.errors import ConfigError
from polytrain.strategies.ps.staleness import StalenessPolicy, global_clock


def test_fully_asynchronous_never_waits():
    policy = StalenessPolicy(None)
    assert policy.may_start(1000, [-1, 5])
    assert "fully asynchronous" in policy.describe()


def test_bulk_synchronous_waits_for_every_worker_to_finish_the_previous_step():
    policy = StalenessPolicy(0)
    assert policy.may_start(0, [-1, -1])
    assert not policy.may_start(1, [0, -1])
    assert policy.may_start(1, [0, 0])
    assert not policy.may_start(2, [1, 0])
    assert policy.synchronous


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_rule_no_worker_starts_c_plus_k_plus_1_before_all_finished_c(bound):
    policy = StalenessPolicy(bound)
    for finished in itertools.product(range(-1, 6), repeat=3):
        for clock in range(0, 10):
            allowed = policy.may_start(clock, finished)
            # the definition: starting `clock` needs every worker to have finished clock - bound - 1
            assert allowed == all(f >= clock - bound - 1 for f in finished)
            assert allowed == (min(finished) >= policy.earliest_wait(clock))


def test_global_clock_counts_steps_every_worker_finished():
    assert global_clock([-1, 3]) == 0
    assert global_clock([2, 3, 7]) == 3
    assert global_clock([]) == 0


def test_negative_bound_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--staleness must be >= 0"):
        StalenessPolicy(-1)


def test_describe_states_the_rule():
    assert StalenessPolicy(2).describe() == ("staleness bound 2: no worker starts step c+3 before every worker "
                                             "has finished step c")
