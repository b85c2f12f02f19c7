"""LostRanks: the registry of expendable ranks and their losses (the heartbeat reports, servers listen)."""

import threading
from dataclasses import replace

import pytest

from polytrain.distributed.lost import LostRanks
from polytrain.distributed.topology import Topology


def test_a_loss_is_reported_once_and_kept_with_its_reason():
    lost = LostRanks([1, 2])
    assert lost.expendable == frozenset({1, 2}) and lost.lost() == {} and 1 not in lost
    assert lost.report(2, "rank 2 sent no heartbeat for 3.1 s") is True
    assert lost.report(2, "rank 2 failed: later news") is False  # the first reason stays
    assert 2 in lost and 1 not in lost
    copy = lost.lost()
    assert copy == {2: "rank 2 sent no heartbeat for 3.1 s"}
    copy[1] = "not through report"
    assert 1 not in lost  # a copy, not the registry


def test_a_rank_that_is_not_expendable_cannot_be_reported():
    lost = LostRanks([1])
    with pytest.raises(ValueError, match=r"^rank 0 is not expendable \(expendable: \[1\]\); its loss ends the job$"):
        lost.report(0, "gone")
    with pytest.raises(ValueError, match=r"expendable: none"):
        LostRanks().report(1, "gone")
    assert lost.lost() == {}


def test_listeners_hear_each_loss_once_and_a_late_listener_hears_the_earlier_ones():
    lost = LostRanks([1, 2, 3])
    early, late = [], []
    lost.listen(lambda rank, reason: early.append((rank, reason)))
    lost.report(1, "one")
    lost.report(1, "one again")
    lost.listen(lambda rank, reason: late.append((rank, reason)))
    assert late == [(1, "one")]  # at once, in listen
    lost.report(3, "three")
    assert early == [(1, "one"), (3, "three")] and late == [(1, "one"), (3, "three")]


def test_a_listener_runs_in_the_reporting_thread_and_may_use_the_registry():
    lost = LostRanks([1])
    seen = []
    lost.listen(lambda rank, reason: seen.append((threading.current_thread().name, rank in lost, lost.lost())))
    thread = threading.Thread(target=lost.report, args=(1, "gone"), name="reporter")
    thread.start()
    thread.join(5)
    assert seen == [("reporter", True, {1: "gone"})]  # called outside the lock: no deadlock


def test_a_failing_listener_does_not_keep_the_news_from_the_others(caplog):
    lost = LostRanks([1])
    heard = []

    def broken(rank, reason):
        raise RuntimeError("a listener bug on purpose")

    lost.listen(broken)
    lost.listen(lambda rank, reason: heard.append(rank))
    assert lost.report(1, "gone") is True
    assert heard == [1]
    assert "a listener for lost ranks failed on rank 1: RuntimeError: a listener bug on purpose" in caplog.text


def test_concurrent_reports_of_one_rank_make_one_loss_and_every_listener_hears_every_loss_once():
    ranks = list(range(1, 9))
    lost = LostRanks(ranks)
    heard: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(len(ranks) * 3 + len(heard))
    news = []

    def reporter(rank):
        start.wait()
        news.append(lost.report(rank, f"rank {rank} gone"))

    def listener(i):
        start.wait()
        lost.listen(lambda rank, reason: heard[i].append(rank))  # list.append is atomic

    threads = [threading.Thread(target=reporter, args=(rank,)) for rank in ranks for _ in range(3)]
    threads += [threading.Thread(target=listener, args=(i,)) for i in range(len(heard))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(news) == [False] * (2 * len(ranks)) + [True] * len(ranks)
    assert lost.lost() == {rank: f"rank {rank} gone" for rank in ranks}
    assert all(sorted(h) == ranks for h in heard), heard


def test_a_topology_and_its_copies_share_one_registry():
    topology = Topology(rank=1, world_size=3, lost=LostRanks([2]))
    view = replace(topology, rank=0, world_size=1)
    view.lost.report(2, "gone")
    assert 2 in topology.lost
    assert Topology().lost.expendable == frozenset() and Topology().lost is not Topology().lost
    assert topology == replace(topology, lost=LostRanks())  # not part of equality
    assert "lost" not in repr(topology)
