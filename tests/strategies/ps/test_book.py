import random

import pytest

from polytrain.errors import CommunicationError
from polytrain.strategies.ps.book import ServerBook
from polytrain.strategies.ps.staleness import StalenessPolicy


def test_duplicate_push_is_ignored_and_recorded():
    book = ServerBook([0, 1], StalenessPolicy(None))
    assert book.admit(0, 0) == 0  # worker 0's fixed slice of step 0: ticket 0
    book.applied(0, 0, read_version=0)
    assert book.admit(0, 0) is None
    assert book.duplicates == [(0, 0)]
    assert book.updates == 1
    assert book.summary()["records"] == [(0, 0, 0, 0, 0, 0)]  # worker, clock, ticket, read, applied, missed


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


def test_tickets_go_to_whoever_asks_and_a_step_finishes_when_all_its_slices_are_applied():
    book = ServerBook([0, 1], StalenessPolicy(0))
    assert book.take_ticket(0, 0) == 0 and book.pull(0, 0)
    read = book.replied(0)
    book.applied(0, 0, read, book.admit(0, 0, 0))
    assert book.take_ticket(0, 0) == 1  # worker 0 is fast: it takes step 0's second slice too
    assert book.pull(0, 0)
    book.applied(0, 1, book.replied(0), book.admit(0, 1, 1))
    assert book.take_ticket(0, 0) is None and book.take_ticket(1, 0) is None  # step 0: nothing left
    assert book.version() == 1 and book.caught_up(1) and not book.caught_up(2)
    assert book.take_ticket(1, 1) == 2 and book.take_ticket(0, 1) == 3
    book.finish(1)
    with pytest.raises(CommunicationError, match="worker rank 1 sent a message after saying it was done"):
        book.pull(1, 1)


def test_slices_applied_out_of_order_finish_a_step_once_the_gap_closes():
    book = ServerBook([0, 1], StalenessPolicy(None))
    book.start_at(5)  # a resumed run: tickets from 10, every worker's clocks from 5
    assert [book.take_ticket(w, 5) for w in (0, 1)] == [10, 11]
    book.applied(1, 5, 5, book.admit(1, 5, 11))
    assert book.version() == 5  # slice 10 is still out
    book.applied(0, 5, 5, book.admit(0, 5, 10))
    assert book.version() == 6
    with pytest.raises(CommunicationError, match="worker rank 0 pushed slice 10 .step 5., which is already applied"):
        book.admit(0, 6, 10)


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
            assert book.admit(w, clock[w]) == clock[w] * 3 + w  # the worker's fixed slice
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


def test_protocol_violations_name_the_sender():
    book = ServerBook([0, 1], StalenessPolicy(0))
    with pytest.raises(CommunicationError, match="^a message claims to come from rank 5, which is not a worker$"):
        book.pull(5, 0)
    assert book.pull(0, 0) and book.pull(1, 0)
    book.replied(0), book.replied(1)
    book.admit(0, 0), book.applied(0, 0, 0)
    assert not book.pull(0, 1)  # deferred: worker 1 has not finished step 0
    with pytest.raises(CommunicationError,
                       match="^worker rank 0 asked for step 2 while its pull for step 1 was still waiting$"):
        book.pull(0, 2)
    with pytest.raises(CommunicationError,
                       match=r"^worker rank 0 pushed slice 0 \(step 0\), which is already applied$"):
        book.admit(0, 1, ticket=0)


# -- lost workers (--tolerate-worker-loss) ----------------------------------------------------------------


def _push(book: ServerBook, worker: int, clock: int, ticket: int) -> None:
    admitted = book.admit(worker, clock, ticket)
    assert admitted == ticket
    book.received(worker, ticket)
    book.applied(worker, clock, book.version(), ticket)


def test_a_lost_workers_slices_go_out_again_first_and_each_is_applied_once():
    book = ServerBook([0, 1, 2], StalenessPolicy(None), tolerant=True)
    assert [book.take_ticket(w, 5) for w in (0, 1, 2)] == [0, 1, 2]
    assert book.take_ticket(2, 5) == 3  # worker 2 holds tickets 2 and 3 (a slice and the next step's)
    _push(book, 0, 0, 0)
    _push(book, 2, 0, 2)  # worker 2 pushed ticket 2, then died holding ticket 3
    assert book.lose(2) == [3]
    assert book.lose(2) == []  # learnt twice (heartbeat, then a failed send): once
    assert book.all_done is False and book.active == [0, 1]
    assert book.take_ticket(1, 5) == 3  # the requeued slice before the next new one
    assert book.take_ticket(1, 5) == 4
    _push(book, 1, 0, 1), _push(book, 1, 1, 3)
    assert book.version() == 1 and not book.caught_up(2)  # step 1: ticket 4 held by worker 1, 5 not handed
    summary = book.summary()
    assert summary["workers_lost"] == [2] and summary["slices_requeued"] == 1
    assert sorted(r[2] for r in summary["records"]) == [0, 1, 2, 3]  # every ticket applied once


def test_a_requeued_slice_of_a_past_step_only_goes_to_a_worker_at_that_step_or_later():
    book = ServerBook([0, 1], StalenessPolicy(None), tolerant=True)
    assert book.take_ticket(1, 3) == 0 and book.take_ticket(1, 3) == 1 and book.take_ticket(1, 3) == 2
    book.lose(1)
    assert book.tickets.requeued == [0, 1, 2]
    assert book.take_ticket(0, 0) == 0 and book.take_ticket(0, 0) == 1
    assert book.take_ticket(0, 0) is None  # ticket 2 is step 1's
    assert book.take_ticket(0, 1) == 2


def test_a_pull_waiting_on_the_bound_takes_an_earlier_requeued_slice_instead():
    book = ServerBook([0, 1, 2], StalenessPolicy(0), tolerant=True)
    for w in (0, 1, 2):
        assert book.take_ticket(w, 0) == w and book.pull(w, 0)
        book.replied(w)
    _push(book, 0, 0, 0)
    assert book.take_ticket(0, 1) == 3 and not book.pull(0, 1)  # step 1 waits for step 0's slices
    assert book.swap(0, 3) is None  # nothing requeued yet
    assert book.lose(2) == [2]
    assert book.swap(0, 3) == 2  # worker 0 computes the lost slice of step 0 instead; 3 goes back
    assert book.tickets.requeued == [3] and book.holding[0] == {2}
    assert book.ready() == [(0, 0)]
    _push(book, 0, 1, 2), _push(book, 1, 0, 1)
    assert book.version() == 1
    assert book.take_ticket(1, 1) == 3


def test_another_server_skips_what_a_lost_worker_pushed_only_to_the_first_server():
    book = ServerBook([0, 1], StalenessPolicy(None), tolerant=True)  # a server after the first
    book.announce(1, 1)  # worker 1 pulled for ticket 1 (pushed to server 0, lost before it reached this one)
    book.announce(1, 3)  # and for ticket 3, which server 0 did not get either: requeued, computed again
    book.announce(0, 0)
    _push(book, 0, 0, 0)
    assert book.abandon(1, requeued=[3]) == [1]
    assert book.version() == 1 and book.summary()["slices_skipped"] == [1]
    assert book.abandon(1, requeued=[3]) == []
    _push(book, 0, 1, 3)
    assert book.caught_up(1) and 3 in book.tickets.above


def test_a_tolerant_server_drains_a_second_push_of_an_applied_slice():
    book = ServerBook([0, 1], StalenessPolicy(None), tolerant=True)
    _push(book, 1, 0, 0)  # a lost worker's push reached this server only; ticket 0 was computed again
    assert book.admit(0, 0, 0) is None
    assert book.duplicates == [(0, 0)] and book.admit(0, 1, 1) == 1  # worker 0's clocks go on
    strict = ServerBook([0, 1], StalenessPolicy(None))
    _push(strict, 1, 0, 0)
    with pytest.raises(CommunicationError, match="already applied"):
        strict.admit(0, 0, 0)
