"""A parameter server that dies or hangs mid-run: the workers stop with an error naming it, never hang."""

import pytest

from polytrain.errors import CommunicationError
from tests.helpers.spawn import spawn
from tests.strategies.ps.jobs import ps_job


@pytest.mark.parametrize("bound", [None, 0])
def test_a_server_that_exits_abruptly_is_named_by_the_workers(bound):
    cfg = {"workers": 2, "servers": 1, "steps": 6, "bound": bound, "optimizer": "dying", "timeout": 60}
    # the workers see the connection drop at once (long before the 60 s timeout) and say who is gone
    with pytest.raises(CommunicationError, match=r"\[rank [01]\] worker rank [01]: connection lost while "
                                                 r"(waiting for|sending to) parameter server rank 2; it exited"):
        spawn(ps_job, 3, cfg, timeout=60)


def test_a_server_that_stops_answering_is_named_when_the_timeout_ends():
    cfg = {"workers": 2, "servers": 1, "steps": 6, "bound": 0, "optimizer": "hanging", "timeout": 3}
    with pytest.raises(CommunicationError, match=r"worker rank [01]: no answer within 3 s while (waiting for|sending "
                                                 r"to) parameter server rank 2; it died or hangs"):
        spawn(ps_job, 3, cfg, timeout=60)
