"""Heartbeat failure detection on real processes and a real c10d store, with no supervisor reacting.

The members below are started with plain multiprocessing (not the launcher, whose supervisor would stop
everyone as soon as a process dies): what ends the survivors is their heartbeat alone, while their main
threads are blocked in waits that would otherwise last 60 s.
"""

import os
import signal
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import polytrain
from polytrain.distributed.heartbeat import Heartbeat
from polytrain.distributed.processes import start_context as _start_context
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.rendezvous import StoreServer, connect_store, loopback_interface
from polytrain.errors import PeerLostError, WorkerError
from tests.helpers.procs import leftover_children

# heartbeat bounds of 3-4 s: a live rank's beat is not late by that much while the other pytest-xdist worker (and a
# CPU burner) run beside these tests, so they need not run alone (tests/helpers/serial.py)
TIMEOUT = 4.0  # heartbeat bound in these tests (2.5 s needed the machine to itself)
LOST = 17  # the exit code a member uses when its heartbeat reports a loss


def _member(rank, world, port, scenario, results):
    store = connect_store("127.0.0.1", port, timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))

    def lost(error):
        results.put((rank, error.rank, str(error), time.monotonic()))
        os._exit(LOST)

    beat = Heartbeat(store.clone(), rank, world, timeout=TIMEOUT, on_lost=lost).start()
    dist.barrier()
    if scenario == "kill":
        if rank == 3:  # a normal early end (a parameter server, a last pipeline stage): not a death
            beat.goodbye()
            return
        if rank == 2:  # dies once rank 3 has been gone longer than the bound
            time.sleep(1.3 * TIMEOUT)
            os.kill(os.getpid(), signal.SIGKILL)
        # ranks 0 and 1 block in a long c10d wait (a gloo op would fail at once here: gloo fails pending
        # operations when any peer's connection closes, and rank 2's does when it is killed)
        store.wait(["never set"], timedelta(seconds=60))
    elif scenario == "freeze":
        if rank == 2:  # a machine that vanished: no beat, but its sockets stay open
            os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(torch.ones(1))  # ranks 0 and 1 wait for rank 2 inside a collective
    os._exit(0)


def _run(scenario, world, monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", loopback_interface())
    server = StoreServer(timedelta(seconds=30))
    ctx = _start_context()  # the launcher's forkserver: a member starts in a fraction of a second
    results = ctx.SimpleQueue()  # put() writes at once: the member calls os._exit right after
    procs = [ctx.Process(target=_member, args=(rank, world, server.port, scenario, results)) for rank in range(world)]
    try:
        for proc in procs:
            proc.start()
        victim = procs[2]
        deadline = time.monotonic() + 120  # a hang guard only
        if scenario == "kill":
            victim.join(120)
            gone_at = time.monotonic()
        else:
            while _state(victim.pid) != "T":
                assert time.monotonic() < deadline, "rank 2 never stopped"
                time.sleep(0.01)
            gone_at = time.monotonic()
        for proc in procs[:2]:
            proc.join(60)
        reports = [results.get() for proc in procs[:2] if proc.exitcode == LOST]
        return reports, gone_at, [p.exitcode for p in procs[:2]]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        server.close()


def _state(pid):
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def _assert_named_in_time(reports, gone_at, codes):
    assert sorted(r[0] for r in reports) == [0, 1] and codes == [LOST, LOST]
    for _, lost_rank, message, at in reports:
        assert lost_rank == 2 and message.startswith("rank 2 (host "), message
        assert "sent no heartbeat for" in message
        # the bound, plus one beat interval to notice, plus scheduling slack on a loaded machine: the heartbeat's
        # report, not the end of the survivors' 60 s waits
        assert at - gone_at < TIMEOUT + 8.0, f"reported {at - gone_at:.1f} s after the death"


def test_a_killed_rank_is_named_on_every_survivor_within_the_bound_and_a_goodbye_is_not(monkeypatch):
    reports, gone_at, codes = _run("kill", 4, monkeypatch)
    _assert_named_in_time(reports, gone_at, codes)


def test_a_frozen_rank_ends_survivors_blocked_in_a_collective(monkeypatch):
    reports, gone_at, codes = _run("freeze", 3, monkeypatch)
    _assert_named_in_time(reports, gone_at, codes)


class _Lost:
    """An ``on_lost`` for heartbeats in this process: keeps every report, signals the first."""

    def __init__(self) -> None:
        self.errors: list[PeerLostError] = []
        self.seen = threading.Event()

    def __call__(self, error: PeerLostError) -> None:
        self.errors.append(error)
        self.seen.set()


def test_a_failure_is_told_at_once_not_after_the_bound():
    """Two heartbeats in one process on a real store: a failed rank's message reaches the other in about one
    beat interval, not after the bound (60 s here, so that no load comes near it)."""
    server = StoreServer(timedelta(seconds=10))
    try:
        on_lost = _Lost()
        lost, seen = on_lost.errors, on_lost.seen

        watcher = Heartbeat(server.store.clone(), 0, 2, timeout=60.0, interval=0.1, on_lost=on_lost).start()
        other = Heartbeat(server.store.clone(), 1, 2, timeout=60.0, interval=0.1, on_lost=on_lost).start()
        time.sleep(0.3)
        assert not lost
        started = time.monotonic()
        other.failed("ValueError: boom")
        assert seen.wait(60)
        assert time.monotonic() - started < 30  # about one beat interval; the bound would be 60 s
        assert lost[0].rank == 1 and "rank 1 (host" in str(lost[0])
        assert str(lost[0]).endswith("failed: ValueError: boom")
        watcher.goodbye()
    finally:
        server.close()


def _host_store(port_out):
    server = StoreServer(timedelta(seconds=30))
    port_out.put(server.port)
    time.sleep(120)  # until stopped and killed by the test


STORE_TIMEOUT = 3.0


def test_a_store_that_stops_answering_is_reported_even_if_a_call_blocks():
    """The store's host frozen (SIGSTOP: its connections stay open and silent, as when its machine leaves the
    network): every heartbeat reports the store within twice the bound plus slack."""
    ctx = _start_context()
    ports = ctx.SimpleQueue()
    host = ctx.Process(target=_host_store, args=(ports,))
    host.start()
    try:
        port = ports.get()
        lost, seen, beats = [], threading.Event(), []

        def on_lost(error):
            lost.append(error)
            seen.set()

        beats += [Heartbeat(connect_store("127.0.0.1", port, timedelta(seconds=10)), rank, 2, timeout=STORE_TIMEOUT,
                           on_lost=on_lost).start() for rank in range(2)]
        time.sleep(0.5)
        os.kill(host.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        assert seen.wait(40)
        assert time.monotonic() - frozen < 2 * STORE_TIMEOUT + 8.0
        store = f"the rendezvous store at 127.0.0.1:{port} "
        assert lost[0].rank is None and (str(lost[0]).startswith(store + "has not answered for")
                                         or str(lost[0]).startswith(store + "stopped answering"))
    finally:
        host.kill()
        host.join()
    for beat in beats:
        beat.goodbye()  # stops its threads


def _freeze_rank_2(ctx):
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    dist.all_reduce(torch.ones(1))


def test_the_launcher_names_a_frozen_rank_and_leaves_no_process():
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 2 \(host .*\) sent no heartbeat for") as info:
        polytrain.launch(_freeze_rank_2, workers=3, device="cpu", backend="gloo", timeout=600,
                         threads_per_worker=1, heartbeat_timeout=TIMEOUT)
    assert isinstance(info.value, PeerLostError)
    assert time.monotonic() - started < 300  # the heartbeat's bound, not the all-reduce's 600 s timeout
    assert leftover_children(os.getpid()) == []


def test_a_rank_that_never_beats_is_named_after_the_start_bound():
    """A real store and one heartbeat of a world of 2 whose rank 1 never starts."""
    server = StoreServer(timedelta(seconds=10))
    try:
        on_lost = _Lost()
        lost, seen = on_lost.errors, on_lost.seen

        watcher = Heartbeat(server.store.clone(), 0, 2, timeout=5.0, interval=0.1, start_timeout=0.5,
                            on_lost=on_lost).start()
        assert seen.wait(5)
        assert lost[0].rank == 1 and isinstance(lost[0], PeerLostError)
        assert str(lost[0]) == "rank 1 sent no heartbeat within 0.5 s of the start: it did not start, or died starting"
        watcher.goodbye()
    finally:
        server.close()


def test_expendable_ranks_are_reported_to_the_registry_and_the_others_still_watched():
    """One heartbeat of a world of 4 on a real store: rank 1 (expendable) fails, rank 2 (expendable) and rank 3
    never start. Ranks 1 and 2 go to the registry, once each; only rank 3 is the job's loss."""
    server = StoreServer(timedelta(seconds=10))
    try:
        on_lost, registry, heard = _Lost(), LostRanks([1, 2]), []
        registry.listen(lambda rank, reason: heard.append((rank, reason)))
        watcher = Heartbeat(server.store.clone(), 0, 4, timeout=5.0, interval=0.1, start_timeout=1.5,
                            on_lost=on_lost, lost=registry).start()
        other = Heartbeat(server.store.clone(), 1, 4, timeout=5.0, interval=0.1, on_lost=_Lost()).start()
        other.failed("ValueError: boom")
        assert on_lost.seen.wait(10)
        assert [e.rank for e in on_lost.errors] == [3]
        assert str(on_lost.errors[0]).startswith("rank 3 sent no heartbeat within 1.5 s of the start")
        assert [rank for rank, _ in heard] == [1, 2]  # rank 1 at its failure mark, before rank 2's start bound
        assert heard[0][1].startswith("rank 1 (host ") and heard[0][1].endswith("failed: ValueError: boom")
        assert heard[1][1] == "rank 2 sent no heartbeat within 1.5 s of the start: it did not start, or died starting"
        watcher.goodbye()
    finally:
        server.close()


# -- expendable ranks (--tolerate-worker-loss): their loss is news for the others, not the end of the job ------

EXPENDABLE_TIMEOUT = 3.0
SURVIVE_S = 9.0  # how long the survivors go on: longer than the bound and its slack, so the heartbeat has judged rank 2


def _lose_rank_2(ctx, how):
    """Rank 2 goes (``how``: "kill" or "freeze") once every rank beats; the others go on for SURVIVE_S and
    return what their registry heard, and when."""
    started = time.monotonic()
    if ctx.rank == 2:
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    heard = []
    ctx.topology.lost.listen(lambda rank, reason: heard.append((rank, reason, time.monotonic() - started)))
    time.sleep(SURVIVE_S)  # no collective: gloo would fail one at once when a peer's connection closes
    return {"rank": ctx.rank, "heard": heard, "lost": ctx.topology.lost.lost(),
            "expendable": sorted(ctx.topology.lost.expendable)}


def _launch_losing_rank_2(how, caplog):
    with caplog.at_level("WARNING"):
        return polytrain.launch(_lose_rank_2, how, workers=3, device="cpu", backend="gloo", timeout=60,
                                threads_per_worker=1, heartbeat_timeout=EXPENDABLE_TIMEOUT, expendable=[2])


def _assert_rank_2_lost(results):
    assert results[2] is None and [r["rank"] for r in results[:2]] == [0, 1]
    for result in results[:2]:
        assert result["expendable"] == [2]
        (rank, reason, after), = result["heard"]  # once, by the heartbeat's thread
        assert rank == 2 and result["lost"] == {2: reason}
        assert reason.startswith("rank 2 (host ") and "sent no heartbeat for" in reason, reason
        assert after < EXPENDABLE_TIMEOUT + 5.0, f"heard {after:.1f} s after the start"  # bound + a beat + slack


def test_a_killed_expendable_rank_is_news_for_the_survivors_not_the_end_of_the_job(caplog):
    results = _launch_losing_rank_2("kill", caplog)
    _assert_rank_2_lost(results)
    warnings = [r.getMessage() for r in caplog.records if "going on without it" in r.getMessage()]
    assert warnings == ["worker rank 2 was killed by signal SIGKILL; going on without it (--tolerate-worker-loss)"]
    assert leftover_children(os.getpid()) == []


def test_a_frozen_expendable_rank_is_stopped_once_the_others_are_done(caplog):
    results = _launch_losing_rank_2("freeze", caplog)
    _assert_rank_2_lost(results)
    warnings = [r.getMessage() for r in caplog.records if "going on without it" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("worker rank 2 was still running "), warnings
    assert leftover_children(os.getpid()) == []


def _kill_rank(ctx, victim):
    if ctx.rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # until stopped by the launcher


def test_a_rank_that_is_not_expendable_still_ends_the_job():
    started = time.monotonic()
    with pytest.raises(WorkerError, match=r"^worker rank 1 was killed by signal SIGKILL.*; all workers were stopped "
                       r"\(worker rank 1 cannot be lost: only rank\(s\) 2 may be\)$"):
        polytrain.launch(_kill_rank, 1, workers=3, device="cpu", backend="gloo", timeout=60, threads_per_worker=1,
                         heartbeat_timeout=EXPENDABLE_TIMEOUT, expendable=[2])
    assert time.monotonic() - started < 300  # stopped, not at the end of the others' 600 s sleep
    assert leftover_children(os.getpid()) == []


def _freeze_rank_0(ctx):
    if ctx.rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)  # expendable ranks 1 and 2: until their heartbeat ends them


def test_expendable_ranks_that_lose_rank_0_end_the_job_naming_it():
    """Rank 0 frozen, its process alive: only the expendable ranks' heartbeats see it. Their PeerLostError is
    the job's failure, not two losses to go on without (the launcher would wait for rank 0 for ever)."""
    started = time.monotonic()
    with pytest.raises(PeerLostError, match=r"^\[rank [12]\] rank 0 \(host .*\) sent no heartbeat for"):
        polytrain.launch(_freeze_rank_0, workers=3, device="cpu", backend="gloo", timeout=60, threads_per_worker=1,
                         heartbeat_timeout=EXPENDABLE_TIMEOUT, expendable=[1, 2])
    assert time.monotonic() - started < 300  # ended by the heartbeat, not at the end of the 600 s sleep
    assert leftover_children(os.getpid()) == []
