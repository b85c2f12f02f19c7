"""A membership that changes while the job runs (``--on-failure continue``): the survivors of a lost worker agree
on who is left, a replacement asks to join, and every membership gets a process group of its own.

Each process of a spawned job has a *slot*: its rank at launch (a replacement takes the slot of the worker it
replaces; the heartbeat watches slots). A *generation* is one membership: the slots that train together, in rank
order (rank = place in that order: the members that go on in their order, then the joiners in slot order), with a
process group made afresh under its own store prefix (``polytrain/elastic/g<N>/pg``), so nothing a dead member
published is ever read again.

Going from generation N to N+1, to leave a lost member behind or to let joiners in (:meth:`Membership.change`):

1. every member taking part aborts its generation-N group first: a peer still blocked on it inside a collective
   gets an error at once (a group is not released by an error alone; measured: 30 s blocked otherwise);
2. it *arrives*: ``g<N+1>/arrive/<slot>`` holds the last step whose state it holds (``committed``);
3. it waits until every slot of generation N has arrived or was reported lost by the heartbeat (so within
   ``--heartbeat-timeout`` plus a beat), then proposes the arrived slots, with the joiners waiting, as
   generation N+1; the first proposal stored (the store's ``compare_set``) is the decision everyone reads;
4. a member missing from the decision (it arrived after it) leaves; the joiners in it are admitted;
5. every member of N+1 makes the new group. The step to continue from is the largest ``committed`` of the
   decision; a member behind it (or a joiner) receives the state from a member that holds it, over the new
   group (the trainer's side: :mod:`polytrain.train.elastic`).

Before the new group is made (:meth:`Membership.make_group`), every member of it says ``g<N+1>/ready/<slot>`` and
waits until each member did or is dead: a member that dies between the decision and the group (a second death
during a change) is found at once, and the others agree again without it, instead of waiting out ``--timeout``
for it inside the group's rendezvous. The same wait comes again before the strategy is built over the new group
(:meth:`Membership.ready_to_build`: ``g<N+1>/build/<slot>``), whose mesh makes groups of its own (fsdp's
``dp_replicate x dp_shard``): a member lost while the others rebuilt (a sharded model's fresh copy takes seconds)
would otherwise leave them waiting in those groups' rendezvous, where cutting connections releases nothing.

A replacement (:func:`polytrain.distributed.joining.join`) registers under ``join/<slot>`` (the time) and waits
for ``admitted/<slot>`` (or for the job to end: ``closed``); the members look for joiners at step boundaries
(:meth:`Membership.joiners_waiting`).
The launcher marks each death under ``dead/<slot>`` (the time): a mark older than the slot's registration is the
replaced process's. No key a member reads is ever deleted (one deleted between a member's check and its read
reads empty, or waits out the store's timeout).

Any slot may be lost, slot 0 included: the store is the launching process's, and so is the supervision
(:mod:`polytrain.distributed.launch`). The generation's rank 0 logs, evaluates and writes checkpoints: after a
loss of the one that did, the lowest surviving rank; a joiner never takes it over, as it comes last.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.distributed.elastic_keys import JOIN_COUNT, admitted_key, close_admission, dead_key, join_key, key
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.teardown import cut_connections, forget_meshes
from polytrain.distributed.topology import Topology
from polytrain.errors import CommunicationError
from polytrain.log import EVERY_RANK, get_logger

POLL_S = 0.02
#: for tests: ``SLOT:N``, the member in slot SLOT SIGKILLs itself in the change to generation N, once the decision
#: (which counts it in) was read and before the new group is made (a second death during a change);
#: ``SLOT:N:rebuild``, after the group is made, while the members build the strategy again over it
CHANGE_KILL_ENV = "POLYTRAIN_INJECT_CHANGE_KILL"


class MembershipError(CommunicationError):
    """The membership could not be changed: not a lost peer to go on without (the trainer does not retry)."""


class Excluded(MembershipError):
    """This process arrived after its peers had agreed on the next membership without it."""


@dataclass(frozen=True)
class Generation:
    """One membership: ``slots`` in rank order, and what each member committed when it was agreed."""

    number: int
    slots: tuple[int, ...]
    committed: tuple[tuple[int, int], ...] = ()  # (slot, step) of the members that arrived
    joined: tuple[int, ...] = ()  # slots admitted in this generation
    lost: tuple[int, ...] = ()  # slots of the previous generation left behind

    @property
    def step(self) -> int:
        """The step the members continue from: the most advanced committed state."""
        return max((step for _, step in self.committed), default=0)

    def rank_of(self, slot: int) -> int:
        return self.slots.index(slot)

    def source(self) -> int:
        """The rank whose state the others take (the first that holds :attr:`step`)."""
        holders = [slot for slot, step in self.committed if step == self.step]
        return self.rank_of(min(holders))

    def needs_state(self, slot: int) -> bool:
        """Whether ``slot`` must receive the state: a joiner, or a member behind :attr:`step`."""
        return dict(self.committed).get(slot, -1) != self.step

    @property
    def anyone_needs_state(self) -> bool:
        return any(self.needs_state(slot) for slot in self.slots)

    def to_json(self) -> str:
        return json.dumps({"number": self.number, "slots": list(self.slots), "committed": list(self.committed),
                           "joined": list(self.joined), "lost": list(self.lost)})

    @classmethod
    def from_json(cls, text: bytes | str) -> "Generation":
        d = json.loads(text)
        return cls(d["number"], tuple(d["slots"]), tuple(tuple(p) for p in d["committed"]), tuple(d["joined"]),
                   tuple(d["lost"]))


class Membership:
    """This process's view of the job's membership, and the store protocol that changes it (see the module)."""

    def __init__(self, store: dist.Store, slot: int, generation: Generation, *, backend: str,
                 device: torch.device, timeout: timedelta, lost: LostRanks, heartbeat_timeout: float, launched: int):
        self.store, self.slot, self.generation = store, slot, generation
        self.backend, self.device, self.timeout, self.lost = backend, device, timeout, lost
        self.heartbeat_timeout = heartbeat_timeout
        self.launched = launched  # slots at launch: 0 .. launched-1
        self._joins_seen = 0
        self.agreed: list[Generation] = []  # generations agreed since the last one that trained (:meth:`settled`)
        #: (generation before, its clock) of a change while the job started (train/elastic.py build_session)
        self.start_up_change: tuple[Generation, float] | None = None
        self.interim_beat: Any = None  # a replacement's beats (distributed/joining.py), until its heartbeat starts

    def heartbeat_started(self) -> None:
        """This process's heartbeat beats for its slot now: a replacement's interim beats stop."""
        if self.interim_beat is not None:
            self.interim_beat.stop()
            self.interim_beat = None

    def _key(self, *parts: Any) -> str:
        return key(*parts)

    # -- the group of the current generation ------------------------------------------------------------

    def topology(self) -> Topology:
        g = self.generation
        return Topology(g.rank_of(self.slot), len(g.slots), self.slot, len(g.slots), self.device, self.backend,
                        dist.group.WORLD, self.timeout, lost=self.lost)

    def make_group(self) -> None:
        g = self.generation
        if g.number:
            self._ready(g, "ready", "before the group of generation {n} was made")
        store = dist.PrefixStore(self._key(f"g{g.number}", "pg"), self.store)
        dist.init_process_group(self.backend, store=store, rank=g.rank_of(self.slot), world_size=len(g.slots),
                                timeout=self.timeout)

    def abort_group(self, cut: bool = True) -> None:
        """Forget the current group. With ``cut``, first close its connections: an operation of this process
        blocked in it, and a peer's blocked on this one, fail at once (gloo's abort does not release an operation
        in flight: measured, it waits out --timeout)."""
        if not dist.is_initialized():
            return
        if cut:
            cut_connections(keep_port=getattr(self.store, "port", None))
        with contextlib.suppress(Exception):
            dist.distributed_c10d._abort_process_group()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        forget_meshes()

    # -- changing it ------------------------------------------------------------------------------------

    def watch(self) -> None:
        """Cut this process's connections when the heartbeat reports a member lost: a collective blocked on a
        frozen member fails then, instead of waiting out --timeout (a dead one's connections close by themselves)."""
        def lost(slot: int, reason: str) -> None:
            if slot in self.generation.slots and slot != self.slot and dist.is_initialized():
                cut_connections(keep_port=getattr(self.store, "port", None))

        self.lost.listen(lost)

    def change(self, committed: int, cut: bool = True, admit: bool = True) -> Generation:
        """Agree on the next generation with the other members (and, with ``admit``, any joiners waiting), make
        its group and return it; :class:`Excluded` if the others went on without this process."""
        self.abort_group(cut)
        old, number = self.generation, self.generation.number + 1
        self.store.set(self._key(f"g{number}", "arrive", self.slot), str(committed))
        deadline = time.monotonic() + self.timeout.total_seconds()
        decision_key = self._key(f"g{number}", "decision")
        while True:
            if self.store.check([decision_key]):
                break
            arrived = self._arrived(number, old.slots)
            missing = [s for s in old.slots if s not in arrived and not self._dead(s)]
            if not missing:
                joiners = self._joiners() if admit else []
                members = tuple(s for s in old.slots if s in arrived)  # in their order: rank 0 stays if it can
                proposal = Generation(number, members + tuple(sorted(set(joiners) - set(members))),
                                      tuple(sorted(arrived.items())), tuple(sorted(joiners)),
                                      tuple(s for s in old.slots if s not in arrived))
                self.store.compare_set(decision_key, "", proposal.to_json())
                break
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"--on-failure continue: worker slot(s) {', '.join(map(str, missing))} neither came back to "
                    f"agree on the membership nor were reported lost within --timeout "
                    f"{self.timeout.total_seconds():g} s")
            time.sleep(POLL_S)
        decided = Generation.from_json(self.store.get(decision_key))
        if self.slot not in decided.slots:
            raise Excluded(f"worker slot {self.slot} reached the membership change of generation {number} after "
                           "its peers had agreed on it without it; leaving")
        for slot in decided.joined:  # (every member writes these: any of them may be the one left)
            self.store.set(admitted_key(slot), str(number))
            self.lost.revive(slot)  # the heartbeat watches the newcomer in its slot again
        self.generation = decided
        self.agreed.append(decided)
        _injected_kill(self.slot, number)
        self.make_group()
        return decided

    def ready_to_build(self) -> None:
        """Before the strategy is built again over the current generation's group (its mesh makes groups, each a
        rendezvous in the store): wait until every member is about to, or is dead (then
        :class:`CommunicationError`: the trainer agrees again without it)."""
        g = self.generation
        _injected_kill(self.slot, g.number, "rebuild")
        if len(g.slots) > 1:  # (generation 0: the job's start-up, whose members build again without a lost one)
            self._ready(g, "build", "while generation {n} was being built")

    def _ready(self, generation: Generation, stage: str, when: str) -> None:
        """Say this member reached ``stage`` of making ``generation``, and wait until every member did or is dead:
        :class:`CommunicationError` (a lost peer: the trainer agrees again) for a dead one, :class:`MembershipError`
        past --timeout."""
        self.store.set(self._key(f"g{generation.number}", stage, self.slot), "1")
        others = [s for s in generation.slots if s != self.slot]
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            waiting = [s for s in others if not self.store.check([self._key(f"g{generation.number}", stage, s)])]
            dead = [s for s in waiting if self._dead(s)]
            if dead:
                raise CommunicationError(f"--on-failure continue: worker slot(s) {', '.join(map(str, dead))} died "
                                         f"{when.format(n=generation.number)}; agreeing again without")
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise MembershipError(
                    f"--on-failure continue: worker slot(s) {', '.join(map(str, waiting))} agreed on the membership "
                    f"but did not come to make its group within --timeout {self.timeout.total_seconds():g} s")
            time.sleep(POLL_S)

    def settled(self, before: Generation) -> tuple[list[int], list[int], list[int]]:
        """The slots lost since ``before`` (the last generation that trained), those joined, and the replacements
        admitted and lost again before they trained, over every generation agreed since; forgets them."""
        agreed, self.agreed = self.agreed, []
        lost = [s for s in before.slots if any(s in g.lost for g in agreed)]
        joined = [s for s in self.generation.slots if any(s in g.joined for g in agreed)]
        gone = sorted({s for g in agreed for s in g.joined if s not in self.generation.slots})
        return lost, joined, gone

    def _arrived(self, number: int, slots: tuple[int, ...]) -> dict[int, int]:
        keys = [self._key(f"g{number}", "arrive", s) for s in slots]
        found = {s: k for s, k in zip(slots, keys) if self.store.check([k])}
        if not found:
            return {}
        values = self.store.multi_get(list(found.values()))
        return {s: int(v) for s, v in zip(found, values)}

    def _joiners(self) -> list[int]:
        """Slots registered to join, not admitted yet, and not dead since they registered."""
        return [slot for slot in range(self.launched) if self._joining(slot)]

    def _joining(self, slot: int) -> bool:
        """A replacement registered for ``slot``, not admitted yet and not dead since."""
        if not self.store.check([join_key(slot)]) or self.store.check([admitted_key(slot)]):
            return False
        return not self._died(slot)

    def _died(self, slot: int) -> bool:
        """The launcher marked a death in ``slot`` after the slot's latest registration (an older mark is the
        replaced process's)."""
        dead = self._time_mark(dead_key(slot))
        if dead is None:
            return False
        joined = self._time_mark(join_key(slot))
        return joined is None or dead > joined

    def _time_mark(self, key: str) -> float | None:
        """The time stored under ``key`` (a key only ever set): None where there is none."""
        if not self.store.check([key]):
            return None
        try:
            return float(self.store.get(key))
        except ValueError:
            return None

    def joiners_waiting(self) -> bool:
        """Whether a replacement waits to be admitted (rank 0 asks at step boundaries; one store call while no
        new registration came)."""
        count = int(self.store.add(JOIN_COUNT, 0))
        if count <= self._joins_seen:
            return False
        if self._joiners():
            return True
        self._joins_seen = count  # every registration so far was admitted
        return False

    def wait_for_joiner(self) -> bool:
        """While fewer slots train than at launch, wait (up to --timeout) for a replacement to register (tests:
        ``POLYTRAIN_INJECT_JOIN_AT``); whether one waits."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        while len(self.generation.slots) < self.launched and time.monotonic() < deadline:
            if self.joiners_waiting():
                return True
            time.sleep(POLL_S)
        return self.joiners_waiting()

    def _dead(self, slot: int) -> bool:
        """The process of ``slot`` ended: the launcher marked it (at once), a replacement for it registered (the
        launcher starts one only then), or the heartbeat reported it (within its bound)."""
        return slot in self.lost or self._died(slot) or self._joining(slot)

    def note(self, record: dict[str, Any]) -> None:
        """The main rank's record of the change to the current generation, kept in the store: the summary lists
        every change since launch, whichever member reports it (:meth:`changes`)."""
        self.store.set(self._key(f"g{self.generation.number}", "record"), json.dumps(record))

    def changes(self) -> list[dict[str, Any]]:
        """The records of every change so far, in order (a generation that was agreed but left again before its
        group trained has none)."""
        keys = [self._key(f"g{number}", "record") for number in range(1, self.generation.number + 1)]
        return [json.loads(self.store.get(key)) for key in keys if self.store.check([key])]

    def keep_tracker_runs(self, run_ids: dict[str, str]) -> None:
        self.store.set(self._key("trackers"), json.dumps(run_ids))

    def tracker_runs(self) -> dict[str, str]:
        """The experiment trackers' runs the main rank opened (``--tracker`` value -> run id), to continue."""
        key = self._key("trackers")
        return json.loads(self.store.get(key)) if self.store.check([key]) else {}

    def close(self) -> None:
        """The job's training is over: a replacement still waiting leaves instead of waiting for admission."""
        close_admission(self.store)


def _injected_kill(slot: int, number: int, stage: str = "") -> None:
    """``POLYTRAIN_INJECT_CHANGE_KILL=SLOT:N[:STAGE]`` (tests): SIGKILL this process in the change to generation N,
    at ``stage`` (none: before its group is made; ``rebuild``: before the strategy is built over it; generation 0's
    ``rebuild`` is the start-up, in the first attempt only: a restart's start-up goes through)."""
    spec = os.environ.get(CHANGE_KILL_ENV, "")
    parts = spec.split(":")
    if spec and (int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "") == (slot, number, stage):
        from polytrain.train.faults import attempt_number  # (a testing hook: the restarts are the trainer's)

        if number == 0 and attempt_number():
            return
        get_logger().warning(f"{CHANGE_KILL_ENV}: worker slot {slot} kills itself in the change to generation "
                             f"{number}{' (' + stage + ')' if stage else ''}", extra=EVERY_RANK)
        os.kill(os.getpid(), signal.SIGKILL)


def first_generation(world_size: int) -> Generation:
    return Generation(0, tuple(range(world_size)), tuple((s, 0) for s in range(world_size)))
