"""A replacement's side of ``--on-failure continue`` (the protocol: :mod:`polytrain.distributed.elastic`): it
registers for the slot of the worker it replaces, beats for that slot while it waits, and makes the group of the
generation it is admitted to; and :func:`start`, a spawned worker's membership."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from polytrain.distributed.elastic import POLL_S, Generation, Membership, first_generation
from polytrain.distributed.elastic_keys import (CLOSED, HEARTBEAT_PREFIX, JOIN_COUNT, admitted_key, join_key,
                                                key)
from polytrain.distributed.lost import LostRanks
from polytrain.errors import CommunicationError
from polytrain.log import get_logger

#: for tests: a replacement's main thread pauses this many seconds once admitted, before its heartbeat starts
JOIN_STALL_ENV = "POLYTRAIN_INJECT_JOIN_STALL"


def join(store: dist.Store, slot: int, *, backend: str, device: torch.device, timeout: timedelta,
         lost: LostRanks, heartbeat_timeout: float, launched: int) -> Membership | None:
    """A replacement for ``slot``: register, wait until the members admit it at a step boundary (or until the
    job's training ends: None), and make the new generation's group with them."""
    _fresh_heartbeat(store, slot)
    with contextlib.suppress(Exception):
        store.delete_key(admitted_key(slot))  # (an earlier replacement's)
    beat = _InterimBeat(store, slot, heartbeat_timeout)  # until this process's heartbeat starts
    store.set(join_key(slot), str(time.time()))
    store.add(JOIN_COUNT, 1)
    admitted, closed = admitted_key(slot), CLOSED
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([admitted]):
        if store.check([closed]):
            beat.stop()
            return None
        if time.monotonic() > deadline:
            beat.stop()
            raise CommunicationError(f"--on-failure continue: the replacement for worker slot {slot} was not "
                                     f"admitted within --timeout {timeout.total_seconds():g} s")
        time.sleep(POLL_S)
    number = int(store.get(admitted))
    generation = Generation.from_json(store.get(key(f"g{number}", "decision")))
    membership = Membership(store, slot, generation, backend=backend, device=device, timeout=timeout, lost=lost,
                            heartbeat_timeout=heartbeat_timeout, launched=launched)
    membership.interim_beat = beat
    membership.make_group()
    membership.watch()
    if os.environ.get(JOIN_STALL_ENV):  # (tests: a main thread starved past --heartbeat-timeout here)
        time.sleep(float(os.environ[JOIN_STALL_ENV]))
    get_logger().info(f"replacement for worker slot {slot} admitted: {len(generation.slots)} workers from step "
                      f"{generation.step}")
    return membership


class _InterimBeat:
    """A replacement's beats on its slot's counter from its registration until its own heartbeat
    (:mod:`polytrain.distributed.heartbeat`) starts, which is after it was admitted and made the new group: the
    members watch the slot again from the admission on, and a starved main thread must not look like a death.
    Its own thread and store connection, as the heartbeat's; ``where`` is published at once, so a report names
    this process, not the one it replaces."""

    def __init__(self, store: dist.Store, slot: int, heartbeat_timeout: float):
        self._store, self._key = store.clone(), f"{HEARTBEAT_PREFIX}/beat/{slot}"
        self._store.set(f"{HEARTBEAT_PREFIX}/where/{slot}", json.dumps({"host": socket.gethostname(),
                                                                          "pid": os.getpid()}))
        self._interval = min(1.0, heartbeat_timeout / 4)
        self._stopped = threading.Event()
        self._store.add(self._key, 1)
        threading.Thread(target=self._run, name=f"polytrain-interim-beat-{slot}", daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            with contextlib.suppress(Exception):  # the store gone: the members' heartbeat says so, not this
                self._store.add(self._key, 1)

    def stop(self) -> None:
        self._stopped.set()


def _fresh_heartbeat(store: dist.Store, slot: int) -> None:
    """A replacement beats on its slot's counter; a goodbye or failure mark left there by the worker it replaces
    (counters past 2**40) is cleared, so the others do not take the newcomer for gone."""
    beat = f"{HEARTBEAT_PREFIX}/beat/{slot}"
    if int(store.add(beat, 0)) >= 1 << 40:
        store.set(beat, "1")


def start(store: dist.Store, slot: int, launched: int, *, joining: bool, backend: str, device: torch.device,
          timeout: timedelta, lost: LostRanks, heartbeat_timeout: float) -> Membership | None:
    """This process's membership in a spawned ``--on-failure continue`` job, with its group made: generation 0
    for the workers started with the job, or the generation a replacement is admitted to (None: the job ended
    before it was)."""
    if joining:
        return join(store, slot, backend=backend, device=device, timeout=timeout, lost=lost,
                    heartbeat_timeout=heartbeat_timeout, launched=launched)
    membership = Membership(store, slot, first_generation(launched), backend=backend, device=device,
                            timeout=timeout, lost=lost, heartbeat_timeout=heartbeat_timeout, launched=launched)
    membership.make_group()
    membership.watch()
    return membership
