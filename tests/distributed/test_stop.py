"""The orderly stop's parts in one process: the agreement on a stop step over a real TCPStore, with ranks
simulated step by step, and the signal handlers (first signal: a request; second: at once, or deferred)."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from polytrain.distributed import stop as stop_module
from polytrain.distributed.stop import StopBeforeTraining, StopNow, StopSignal


@pytest.fixture
def store_factory():
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    return lambda: dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def _simulate(store_factory, size, notices, collective, last=1000, lag=()):
    """Ranks that meet at collective steps (none ends such a step before every rank has begun it) and run
    freely between them; rank r learns of the stop at boundary ``notices[r]``; ``lag`` ranks act after the
    others in each round. Returns each rank's stop step, the boundary it was at when it learned it, and where
    each ended. Fails on a deadlock (a round in which nobody moves)."""
    signals = [StopSignal() for _ in range(size)]
    for stop in signals:
        stop.connect(store_factory, watch=False)
    agreements = [stop.agreement(rank, size) for rank, stop in enumerate(signals)]
    at, begun, stopped = [0] * size, [False] * size, [False] * size
    learned: dict[int, int] = {}
    order = [r for r in range(size) if r not in lag] + list(lag)
    while not all(stopped):
        moved = False
        for rank in order:
            if stopped[rank]:
                continue
            if not begun[rank]:  # at a boundary: the trainer's check, then the next step begins
                if at[rank] >= notices[rank]:
                    signals[rank]._name = "SIGTERM"  # the request arrives (as its watcher sets it)
                target = agreements[rank].stop_step(at[rank], collective, last)
                if target is not None:
                    learned.setdefault(rank, at[rank])
                if (target is not None and at[rank] >= target) or at[rank] == last:
                    stopped[rank] = moved = True
                    continue
                begun[rank] = moved = True
            step = at[rank] + 1
            others_began = all(at[r] >= step or (at[r] == step - 1 and begun[r]) for r in range(size))
            if not collective(step) or others_began:
                at[rank], begun[rank], moved = step, False, True
        assert moved, f"deadlock: ranks at {at}, begun {begun}"
    return [a.target for a in agreements], learned, at


@pytest.mark.parametrize("notices", [(5, 5), (5, 6), (6, 5), (3, 9), (0, 0)])
def test_lockstep_ranks_agree_on_one_step_none_has_passed(store_factory, notices):
    targets, learned, at = _simulate(store_factory, 2, notices, collective=lambda b: True)
    assert targets[0] == targets[1] and at == [targets[0]] * 2
    assert all(learned[rank] <= targets[0] for rank in range(2))
    assert targets[0] <= max(notices) + 2  # within two steps of the last rank that heard of it


def test_ranks_that_meet_every_fourth_step_stop_at_a_meeting(store_factory):
    targets, learned, at = _simulate(store_factory, 3, (5, 6, 9), collective=lambda b: b % 4 == 0, lag=(2,))
    assert len(set(targets)) == 1 and targets[0] % 4 == 0 and targets[0] >= 9
    assert at == [targets[0]] * 3


def test_a_stop_past_the_last_step_is_the_last_step(store_factory):
    targets, _, at = _simulate(store_factory, 2, (18, 19), collective=lambda b: True, last=20)
    assert targets == [20, 20] and at == [20, 20]


def test_one_rank_stops_where_it_is():
    stop = StopSignal()
    agreement = stop.agreement(0, 1)
    assert agreement.stop_step(7, lambda b: True, 100) is None
    stop.request("SIGTERM", signal.SIGTERM)
    assert agreement.stop_step(7, lambda b: True, 100) == 7


def test_a_request_reaches_the_other_processes_through_the_store(store_factory):
    sender, receiver = StopSignal(), StopSignal()
    receiver.connect(store_factory)  # its watcher waits for the key
    sender.connect(store_factory, watch=False)
    sender.request("SIGUSR1", signal.SIGUSR1)
    import time

    deadline = time.monotonic() + 60  # a hang guard: one store round trip (milliseconds, seconds under load)
    while receiver.requested is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert receiver.requested == "SIGUSR1"


def test_a_launcher_asked_before_training_began_ends_its_workers_at_once(store_factory):
    launcher, worker = StopSignal(), StopSignal()
    launcher.connect(store_factory, watch=False, launcher=lambda: [])
    worker.connect(store_factory, watch=False)
    launcher.request("SIGTERM", signal.SIGTERM)
    with pytest.raises(StopBeforeTraining):
        launcher.check()
    assert worker.begin() is False  # the worker learns that it must not begin


def test_once_training_began_a_launcher_stops_in_order(store_factory):
    launcher, worker = StopSignal(), StopSignal()
    launcher.connect(store_factory, watch=False, launcher=lambda: [])
    worker.connect(store_factory, watch=False)
    assert worker.begin() is True
    launcher.request("SIGTERM", signal.SIGTERM)
    launcher.check()  # nothing to raise: the workers stop in order


def test_first_signal_asks_second_stops_at_once():
    stop = StopSignal()
    with stop.handling():
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested == "SIGUSR1" and stop.signum == signal.SIGUSR1
        with pytest.raises(StopNow) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
        assert raised.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # restored


def test_one_signal_delivered_twice_counts_once_and_a_later_one_stops_at_once(monkeypatch):
    """``timeout`` and Slurm send a stop to the command and to its process group: the same signal twice within
    microseconds is one request; the same signal sent once the first was taken is a second signal."""
    clock = [100.0]  # the handler's clock, moved by the test: nothing here depends on the machine's speed
    monkeypatch.setattr(stop_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    stop = StopSignal()
    with stop.handling():
        os.kill(os.getpid(), signal.SIGTERM)
        clock[0] += stop_module.REPEAT_WINDOW_S / 2
        os.kill(os.getpid(), signal.SIGTERM)  # the group's copy: no StopNow
        assert stop.requested == "SIGTERM"
        clock[0] += stop_module.REPEAT_WINDOW_S
        with pytest.raises(StopNow) as raised:
            os.kill(os.getpid(), signal.SIGTERM)
        assert raised.value.signum == signal.SIGTERM


def test_a_deferred_second_signal_is_raised_by_check_and_wakes_its_descriptor():
    stop = StopSignal()
    wake = stop.wake_fd
    with stop.handling(), stop.deferring():
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGTERM)  # no exception here: deferred
        assert os.read(wake, 10)
        with pytest.raises(StopNow):
            stop.check()


def test_a_strategy_that_misses_its_collective_steps_is_caught_not_run_past(store_factory):
    """``syncs_at`` true at a step whose work holds no collective lets a rank pass the agreed stop step."""
    ranks = [StopSignal(), StopSignal()]
    for stop in ranks:
        stop.connect(store_factory, watch=False)
        stop._name = "SIGTERM"
    ahead, behind = ranks[0].agreement(0, 2), ranks[1].agreement(1, 2)
    behind.stop_step(2, lambda b: True, 100)  # proposes 3
    assert ahead.stop_step(4, lambda b: b != 5, 100) is None  # proposes 6 (5 said to hold no collective)
    with pytest.raises(RuntimeError, match="stop step 6 agreed while this rank is already at step 7"):
        ahead.stop_step(7, lambda b: True, 100)  # it missed step 6: it ran past the agreed step


def test_a_repeat_that_arrives_while_the_first_is_being_taken_counts_once(monkeypatch):
    """Python may run the second delivery's handler inside the first's (a signal between its bytecodes)."""
    stop = StopSignal()
    request = stop.request

    def slow_request(name, signum=0):  # the group's copy arrives while the first is being taken
        first = request(name, signum)
        os.kill(os.getpid(), signal.SIGTERM)
        return first

    monkeypatch.setattr(stop, "request", slow_request)
    with stop.handling():
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
