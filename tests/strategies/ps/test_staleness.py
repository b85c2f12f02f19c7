import itertools

import pytest

from polytrain.errors import ConfigError
from polytrain.strategies.ps.staleness import StalenessPolicy


def test_fully_asynchronous_never_waits():
    policy = StalenessPolicy(None)
    assert policy.may_start(1000, 0)
    assert "fully asynchronous" in policy.describe()


def test_bulk_synchronous_waits_for_the_previous_step_to_finish():
    policy = StalenessPolicy(0)
    assert policy.may_start(0, 0)
    assert not policy.may_start(1, 0)
    assert policy.may_start(1, 1)
    assert not policy.may_start(3, 2)
    assert policy.synchronous


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_rule_no_slice_of_c_plus_k_plus_1_before_step_c_finished(bound):
    policy = StalenessPolicy(bound)
    for version, step in itertools.product(range(0, 8), range(0, 12)):
        # version v: steps 0..v-1 finished; starting `step` needs step - bound - 1 finished
        assert policy.may_start(step, version) == (version - 1 >= step - bound - 1)


def test_negative_bound_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--staleness must be >= 0"):
        StalenessPolicy(-1)


def test_describe_states_the_rule():
    assert StalenessPolicy(2).describe() == ("staleness bound 2: no slice of step c+3 starts before every slice "
                                             "of step c is applied")
