"""The supervisor with expendable ranks (--tolerate-worker-loss), on real launched workers over gloo.

An expendable rank that fails is a warning and a None result, the others go on; what fails the job still does,
named as before, and an expendable rank lost earlier is never blamed for it.
"""

import os
import re
import signal
import time

import pytest

from polytrain.distributed.launch import launch
from polytrain.errors import WorkerError
from tests.helpers.procs import leftover_children

HEARTBEAT = 3.0  # long enough that a live rank's beat is not late beside the other pytest -n worker
NAMES = ["worker rank 0", "worker rank 1", "helper rank 2"]


def _launch(fn, *args, names=None):
    return launch(fn, *args, workers=3, device="cpu", backend="gloo", timeout=600, threads_per_worker=1,
                  heartbeat_timeout=HEARTBEAT, expendable=[2], rank_names=names)


def _wait_until_lost(ctx, rank, within=30.0):
    """What this rank's registry says about ``rank`` once its heartbeat has reported it."""
    deadline = time.monotonic() + within
    while rank not in ctx.topology.lost:
        assert time.monotonic() < deadline, f"rank {rank} was never reported lost"
        time.sleep(0.05)
    return ctx.topology.lost.lost()[rank]


def _rank_2_ends(ctx, how):
    if ctx.rank == 2:
        if how == "raise":
            raise ValueError("a helper's bug on purpose")
        os._exit(0)  # "exit": ends cleanly, without a result (and without saying goodbye to the heartbeat)
    return ctx.rank, _wait_until_lost(ctx, 2)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if "going on without it" in r.getMessage()]


def test_an_expendable_rank_that_raises_is_a_warning_and_the_job_goes_on(caplog):
    with caplog.at_level("WARNING"):
        results = _launch(_rank_2_ends, "raise", names=NAMES)
    assert results[2] is None and [r[0] for r in results[:2]] == [0, 1]
    for _, reason in results[:2]:  # told at once by rank 2's own failure mark, not after the bound
        assert reason.startswith("helper rank 2 (host ") and reason.endswith("failed: ValueError: a helper's bug on purpose")
    warning, = _warnings(caplog)
    first, *trace = warning.splitlines()
    assert first == ("helper rank 2 failed: ValueError: a helper's bug on purpose; going on without it "
                     "(--tolerate-worker-loss)")
    assert trace and trace[0].startswith("Traceback")  # a bug's traceback, once
    assert leftover_children(os.getpid()) == []


def test_an_expendable_rank_that_exits_without_a_result_is_a_warning_and_the_job_goes_on(caplog):
    with caplog.at_level("WARNING"):
        results = _launch(_rank_2_ends, "exit")
    assert results[2] is None and [r[0] for r in results[:2]] == [0, 1]
    for _, reason in results[:2]:
        assert reason.startswith("rank 2 (host ") and "sent no heartbeat for" in reason
    assert _warnings(caplog) == ["worker rank 2 exited without reporting a result; going on without it "
                                 "(--tolerate-worker-loss)"]


def _rank_0_fails_after_losing_rank_2(ctx):
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    if ctx.rank == 0:
        _wait_until_lost(ctx, 2)
        raise RuntimeError("gloo: connection closed, on purpose")  # ranks below a signal as a cause
    time.sleep(600)  # rank 1: until stopped


def test_a_later_failure_of_a_needed_rank_stops_all_and_the_earlier_loss_is_not_its_cause(caplog):
    started = time.monotonic()
    with caplog.at_level("WARNING"), pytest.raises(WorkerError) as info:
        _launch(_rank_0_fails_after_losing_rank_2)
    # rank 1's heartbeat may report rank 0's failure before it is stopped: "then failed too", but never rank 2
    assert re.fullmatch(r"worker rank 0 failed: RuntimeError: gloo: connection closed, on purpose"
                        r"( \(then rank\(s\) 1 failed too\))?; all workers were stopped "
                        r"\(worker rank 0 cannot be lost: only rank\(s\) 2 may be\)", str(info.value)), info.value
    assert info.value.failed_rank == 0
    assert _warnings(caplog) == ["worker rank 2 was killed by signal SIGKILL; going on without it "
                                 "(--tolerate-worker-loss)"]
    assert time.monotonic() - started < 300  # stopped, not at the end of rank 1's 600 s sleep
    assert leftover_children(os.getpid()) == []


def _everyone_fails_but_rank_2_last(ctx):
    if ctx.rank == 0:
        raise RuntimeError("rank 0's bug on purpose")
    time.sleep(600)  # ranks 1 and 2: until stopped (rank 2 is then no loss to go on without: the job failed)


def test_expendable_ranks_stopped_with_a_failed_job_are_no_warning(caplog):
    with caplog.at_level("WARNING"), pytest.raises(WorkerError, match=r"^worker rank 0 failed: RuntimeError: "
                                                                       r"rank 0's bug on purpose"):
        _launch(_everyone_fails_but_rank_2_last)
    assert _warnings(caplog) == []


def _rank_0_dies_then_rank_1(ctx):
    if ctx.rank == 1:
        _wait_until_lost(ctx, 0)
    os.kill(os.getpid(), signal.SIGKILL)


def test_every_rank_expendable_the_job_fails_once_all_are_lost_naming_the_first(caplog):
    """--on-failure continue's launch (every rank expendable, rank 0 too): a job whose ranks are all lost before
    one reported its result is a failure, the first loss its cause (a survivor's result ends the job: that is
    tests/train/test_elastic.py's)."""
    with caplog.at_level("WARNING"), pytest.raises(WorkerError) as info:
        launch(_rank_0_dies_then_rank_1, workers=2, device="cpu", backend="gloo", timeout=600, threads_per_worker=1,
               heartbeat_timeout=HEARTBEAT, expendable=[0, 1], elastic=True)
    assert re.fullmatch(r"worker rank 0 was killed by signal SIGKILL \(then rank\(s\) 1 failed too\); all workers "
                        r"were stopped", str(info.value)), info.value
    assert _warnings(caplog)[0] == "worker rank 0 was killed by signal SIGKILL; going on without it " \
                                   "(--on-failure continue)"
    assert leftover_children(os.getpid()) == []
