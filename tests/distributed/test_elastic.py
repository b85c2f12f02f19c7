"""The membership protocol's view of a slot, read from the launcher's store as the members read it: the launcher's
death mark and a replacement's registration are compared by time, and no key a member reads is deleted under it
(a TCPStore key deleted between a member's check and its read reads empty: that ended a goodput job's rank 0).
The launcher's marks are set here through the member's own connection: a set on another connection (the server's)
may reach the store after this connection's next read, and the protocol's members only ever poll for them."""

import time
from datetime import timedelta

import torch

from polytrain.distributed.elastic import Membership, first_generation
from polytrain.distributed.elastic_keys import PREFIX, admitted, admitted_key, dead_key, join_key, key, mark_dead
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.rendezvous import StoreServer, connect_store


def _member(store, slot: int) -> Membership:
    return Membership(store, slot, first_generation(3), backend="gloo", device=torch.device("cpu"),
                      timeout=timedelta(seconds=5), lost=LostRanks(range(3)), heartbeat_timeout=3.0, launched=3)


def test_a_slot_is_dead_joining_or_back_as_its_marks_say_and_none_is_deleted_under_a_reader():
    server = StoreServer(timedelta(seconds=5))
    try:
        store = connect_store("127.0.0.1", server.port, timedelta(seconds=5))
        member = _member(store, 0)
        assert not member._dead(2) and member._joiners() == []
        mark_dead(store, 2)  # the launcher's word: slot 2's process ended
        assert member._dead(2) and member._joiners() == []
        time.sleep(0.01)
        store.set(f"{PREFIX}/join/2", repr(time.time()))  # a replacement registered after the death
        assert member._joining(2) and member._dead(2) and member._joiners() == [2]
        store.set(f"{PREFIX}/admitted/2", "1")  # the members admitted it: back, not dead
        assert not member._joining(2) and not member._dead(2)
        assert store.check([f"{PREFIX}/dead/2"])  # (the old process's mark stays: a member may be reading it)
        time.sleep(0.01)
        mark_dead(store, 2)  # the replacement died too
        assert member._dead(2) and not member._joining(2)
        store.set(f"{PREFIX}/dead/1", "")  # what a read of a key deleted under it returns: no mark
        assert not member._dead(1)
    finally:
        server.close()


def test_a_replacement_registered_while_its_slot_is_marked_dead_is_the_joiner():
    """A second replacement for a slot whose first replacement died before it was admitted."""
    server = StoreServer(timedelta(seconds=5))
    try:
        store = connect_store("127.0.0.1", server.port, timedelta(seconds=5))
        member = _member(store, 0)
        store.set(f"{PREFIX}/join/1", repr(time.time()))
        time.sleep(0.01)
        mark_dead(store, 1)  # the first replacement died waiting
        assert member._joiners() == [] and member._dead(1)
        time.sleep(0.01)
        store.set(f"{PREFIX}/join/1", repr(time.time()))
        assert member._joiners() == [1]
    finally:
        server.close()


def test_the_members_read_and_write_the_keys_that_elastic_keys_names():
    server = StoreServer(timedelta(seconds=5))
    try:
        store = connect_store("127.0.0.1", server.port, timedelta(seconds=5))
        member = _member(store, 0)
        mark_dead(store, 2)
        assert store.check([dead_key(2)]) and member._dead(2)
        store.set(join_key(2), repr(time.time() + 1))  # registered after the death
        store.set(admitted_key(2), "1")
        assert admitted(store, 2) and not member._joining(2)
        assert member._key("g1", "decision") == key("g1", "decision") == "polytrain/elastic/g1/decision"
    finally:
        server.close()
