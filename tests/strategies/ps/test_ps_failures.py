"""A parameter server that dies or hangs mid-run: the workers stop with an error naming it, never hang."""

import pytest

from polytrain.errors import CommunicationError, WorkerError
from tests.helpers.spawn import spawn
from tests.strategies.ps.jobs import ps_job


@pytest.mark.parametrize("bound", [None, 0])
def test_a_server_that_exits_abruptly_is_named_by_the_workers(bound):
    cfg = {"workers": 2, "servers": 1, "steps": 6, "bound": bound, "optimizer": "dying", "timeout": 60}
    # the workers see the connection drop at once (long before the 60 s timeout); the error is the server's
    # own exit, which the launcher saw (spawn does not know rank 2 is a server: fit names it so)
    with pytest.raises(WorkerError, match=r"^worker rank 2 exited with code 1 without reporting an error"):
        spawn(ps_job, 3, cfg, timeout=60)


def test_a_server_that_stops_answering_is_named_when_the_timeout_ends():
    cfg = {"workers": 2, "servers": 1, "steps": 6, "bound": 0, "optimizer": "hanging", "timeout": 3}
    with pytest.raises(CommunicationError, match=r"worker rank [01]: no answer within 3 s while (waiting for|sending "
                                                 r"to) parameter server rank 2; it died or hangs"):
        spawn(ps_job, 3, cfg, timeout=60)
