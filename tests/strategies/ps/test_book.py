import random

import pytest

from polytrain.errors import CommunicationError
from polytrain.strategies.ps.book import ServerBook
from polytrain.strategies.ps.staleness import StalenessPolicy


def test_duplicate_push_is_ignored_and_recorded():
    book = ServerBook([0, 1], StalenessPolicy(None))
    assert book.admit(0, 0)
    book.applied(0, 0, read_version=0)
    assert not book.admit(0, 0)
    assert book.duplicates == [(0, 0)]
    assert book.updates == 1
    assert book.summary()["records"] == [(0, 0, 0, 0, 0)]


def test_a_missing_clock_is_an_error_naming_the_worker():
    book = ServerBook([0, 1], StalenessPolicy(None))
    with pytest.raises(CommunicationError, match=r"worker rank 1 pushed step 2 after step -1: step\(s\) 0..1"):
        book.admit(1, 2)


def test_bound_zero_defers_a_pull_until_every_worker_finished():
    book = ServerBook([0, 1], StalenessPolicy(0))
    assert book.pull(0, 0) and book.pull(1, 0)
    book.replied(0), book.replied(1)
    book.admit(0, 0), book.applied(0, 0, 0)
    assert not book.pull(0, 1)  # worker 1 has not finished step 0
    assert book.ready() == []
    assert book.silent() == [1]  # the one a server that times out names
    book.admit(1, 0), book.applied(1, 0, 0)
    assert book.ready() == [(0, 1)]
    assert book.version() == 1


def test_a_done_worker_no_longer_holds_the_others_back():
    book = ServerBook([0, 1], StalenessPolicy(0))
    book.admit(0, 0), book.applied(0, 0, 0)
    assert not book.pull(0, 1)
    book.finish(1)
    assert book.ready() == [(0, 1)]
    with pytest.raises(CommunicationError, match="worker rank 1 sent a message after saying it was done"):
        book.pull(1, 1)


@pytest.mark.parametrize("bound", [0, 1, 3])
def test_random_schedules_keep_staleness_within_bound_and_apply_each_step_once(bound):
    """Simulate 3 workers taking turns at random; every step is pulled, then pushed."""
    rng = random.Random(0)
    book = ServerBook([0, 1, 2], StalenessPolicy(bound))
    steps, clock, read, waiting = 30, {0: 0, 1: 0, 2: 0}, {}, set()
    while not book.all_done:
        free = [w for w in book.active if w not in waiting]
        w = rng.choice(free)
        if clock[w] == steps:
            book.finish(w)
        elif w in read:
            assert book.admit(w, clock[w])
            book.applied(w, clock[w], read.pop(w))
            clock[w] += 1
        elif book.pull(w, clock[w]):
            read[w] = book.replied(w)
        else:
            waiting.add(w)
        for ready, _ in book.ready():
            waiting.discard(ready)
            read[ready] = book.replied(ready)
        assert book.active == [] or set(waiting) != set(book.active), "every active worker is waiting"
    summary = book.summary()
    assert summary["max_staleness"] <= bound
    assert summary["max_staleness"] == bound  # these seeded schedules do reach the bound
    assert sorted((r[0], r[1]) for r in summary["records"]) == [(w, c) for w in range(3) for c in range(steps)]
