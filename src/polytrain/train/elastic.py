"""The trainer's side of ``--on-failure continue``: go on without a lost worker, and let a replacement in.

The trainer's loop runs inside :meth:`ElasticRun.run`. When a collective fails because a member is gone (its
connections closed, the heartbeat reported it, or the group was aborted by a peer that noticed first), the loop
unwinds and the survivors agree on the next membership (:mod:`polytrain.distributed.elastic`). Each reports the
last step whose state it holds (*committed*):

* ``sync`` commits every step: a step is committed by a rank once its gradients were averaged and applied. A
  peer that dies inside a step leaves either every survivor short of that step (its gradients never arrived)
  or some survivors past it (the all-reduce completed, the dead worker's slice included); the group continues
  from the most advanced survivors' step, the others taking their state. So the step in flight is completed by
  all survivors or by none, and its examples are used once.
* ``local-sgd`` and ``diloco`` commit at meetings: each rank keeps a copy of its state there (parameters,
  inner and outer optimizer; one model and optimizer copy in memory). A death inside a round loses that
  round's work of every replica: the survivors return to the round's start and train it again over fewer
  slices (the round in flight is redone by all survivors, or, if its meeting had completed somewhere,
  completed by all).

Then every member builds the strategy again over the new group (DDP wraps the same module again), the state to
continue from is sent from a member that holds it to those that do not (a replacement, or a rank behind) with
one broadcast over the new group, and the loop goes on from that step with the same global batches cut into as
many slices as there are members (differing by one example at most when they do not divide). Nothing is read
from disk. A replacement waiting to join is looked for at step boundaries (``sync``: every ``--log-every`` steps;
``local-sgd``, ``diloco``: meetings): rank 0 reads one store counter, and one one-element all-reduce tells
the others.

The generation's rank 0 logs, evaluates, writes checkpoints and ``--save-model`` and reports the job's summary
(the other members return None to the launcher). When it is lost, the lowest surviving rank takes that over at
the change: its console speaks, the metrics file (and TensorBoard) get its records, appended, and the summary it
reports lists every membership change since launch (``membership_changes``: the main rank of each generation
keeps its record in the store). A joiner comes last in the order, so it takes that over only when every member
from before it is lost.

``--log-example-ids``: the survivors' records of the steps since the last log point are written at the change;
a lost worker's slices of committed steps are the ones the plan gave it (it cannot report them), listed under
``unobserved`` (their slice indices).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from polytrain.data.batches import Slice
from polytrain.distributed.elastic import Generation, Membership, MembershipError
from polytrain.errors import CommunicationError
from polytrain.log import get_logger, setup_logging
from polytrain.train.background import copy_state
from polytrain.train.faults import agree_with_rank0
from polytrain.train.heal import heal
from polytrain.train.on_failure import continuing, members_layout

#: for tests: replacements are admitted at the first step boundary from this step on, which waits for one
JOIN_AT_ENV = "POLYTRAIN_INJECT_JOIN_AT"
#: what a collective raises when a member is gone (gloo's words, c10d's errors)
_LOST_HINTS = ("connection", "gloo", "timed out", "peer", "socket", "broken pipe", "abort", "process group",
               "closed", "reset")


class Regrow(Exception):
    """A replacement is waiting: every member leaves the loop at this step boundary to admit it."""


def slice_of(rank: int, count: int, global_batch: int) -> Slice:
    """Rank ``rank``'s slice of a global batch cut into ``count`` slices (equal, or differing by one example)."""
    if global_batch % count == 0:
        return Slice(rank, count)
    base, extra = divmod(global_batch, count)
    return Slice(rank, count, tuple(base + (i < extra) for i in range(count)))


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing for a member that is gone, rather than an error of this rank's."""
    if isinstance(exc, MembershipError):
        return False
    if isinstance(exc, (CommunicationError, torch.distributed.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(hint in str(exc).lower() for hint in _LOST_HINTS)


class ElasticRun:
    """One rank's ``--on-failure continue`` state: its membership, its committed step (and, between meetings,
    the state there), and the changes so far."""

    def __init__(self, trainer: Any, membership: Membership):
        self.trainer, self.membership = trainer, membership
        self.session = trainer.session
        self.committed = self.session.start_step
        self.snapshot: dict[str, Any] | None = None
        self.changes: list[dict[str, Any]] = []
        self._speaking_as = membership.slot  # the rank this process's logging was set up for (at launch: its slot)
        self._carry: tuple[Any, ...] | None = None  # a change under way: the state it continues from
        self._waited = False  # (tests, JOIN_AT_ENV: this process waited for a joiner once already)
        self._unwritten: dict[str, Any] | None = None  # a start-up change's record, until the metrics file is open
        self._remember(trainer.strategy)
        self._use(trainer.strategy)
        generation = membership.generation
        if membership.slot in generation.joined:  # a replacement: the others wait to hand it the state, then the ids
            self._receive_into(trainer.strategy, generation)
            self._write_ids([], None, generation, generation)
        self._keep(trainer.strategy)
        if membership.start_up_change is not None:  # members lost while the job started
            before, started = membership.start_up_change
            membership.start_up_change = None
            self._record(before, generation, time.perf_counter() - started, None)

    def started(self, run_log: Any) -> None:
        """The main rank's trackers' runs, kept in the store: a rank that takes reporting over continues them; a
        change during the start-up into the metrics file."""
        if self._unwritten is not None:
            run_log._write({"event": "membership", **self._unwritten, "unix_time": time.time()})
            self._unwritten = None
        if self.trainer.topology.is_main and run_log.run_ids():
            self.membership.keep_tracker_runs(run_log.run_ids())

    # -- the loop -----------------------------------------------------------------------------------------

    def run(self, loop: Callable[[], dict[str, Any]], run_log: Any) -> dict[str, Any]:
        failed: bool | None = None  # a change is due: after a failure (True) or to admit a joiner (False)
        while True:
            try:
                if failed is not None:
                    self._change(run_log, failed)
                    failed = None
                summary = loop()
                break
            except Regrow:
                failed = False
            except Exception as exc:
                if not lost_peer(exc):
                    raise
                exc.__traceback__ = None  # its frames hold the old group's objects
                failed = True
        if self.trainer.topology.is_main:
            self.membership.close()
            self.changes = self.membership.changes()  # every change since launch, this process's or not
        summary["membership_changes"] = self.changes
        summary["slots_lost"] = [slot for c in self.changes for slot in c["lost"]]
        summary["slots_joined"] = [slot for c in self.changes for slot in c["joined"]]
        return summary

    def _wrap(self, strategy: Any) -> None:
        """Count committed steps, keep the state at meetings, and look for joiners at step boundaries."""
        inner, layout = strategy.train_step, strategy.layout
        trainers, every = strategy.trainers, self.trainer.config.log.log_every
        # where a joiner may be admitted: meetings (local-sgd, diloco); sync's log points (a step pays nothing)
        boundary = (lambda step: layout.meets_at(step)) if layout.meets_every > 1 else (lambda step: step % every == 0)

        def train_step(batch: Any, lr: float) -> Any:
            if boundary(batch.step) and self._joiner_waiting(trainers, batch.step):
                raise Regrow()
            result = inner(batch, lr)
            if layout.meets_at(batch.step + 1):
                self.committed = batch.step + 1
                self._keep(strategy)
            return result

        strategy.train_step = train_step

    def _joiner_waiting(self, trainers: Any, step: int) -> bool:
        """Whether to admit a joiner before ``step``: rank 0 looks, one one-element all-reduce tells the others."""
        mine = False
        if trainers.is_main:
            at = os.environ.get(JOIN_AT_ENV)
            if at is None:
                mine = self.membership.joiners_waiting()
            elif step >= int(at):  # (tests: admitted at the first boundary from step S, which waits for one,
                # once: a replacement that died before it was admitted leaves none to come, and a wait at every
                # boundary would outlast the others' collective, again and again)
                mine = self.membership.joiners_waiting() if self._waited else self.membership.wait_for_joiner()
                self._waited = True
        return agree_with_rank0(trainers)(mine)

    def _keep(self, strategy: Any) -> None:
        """The committed state: ``sync``'s is the live one; between meetings a copy is kept."""
        self.snapshot = None if strategy.layout.meets_every == 1 else _clone(local_state(strategy))

    def _committed_state(self, strategy: Any) -> dict[str, Any]:
        if self.snapshot is not None:
            return self.snapshot
        if strategy.healing is not None:  # this rank's shards, to heal the others' from (train/heal.py)
            return strategy.healing.piece(local_state(strategy))
        return _clone(local_state(strategy))

    # -- a change of membership ---------------------------------------------------------------------------

    def _change(self, run_log: Any, failed: bool) -> None:
        """Agree on the next membership, rebuild over it and load the state to continue from. A failure on the way
        (another member lost meanwhile) raises, and the next call starts again from the same committed state."""
        started = time.perf_counter()
        self.membership.abort_group(cut=failed)  # first: peers blocked on this rank are released
        trainer, s = self.trainer, self.session
        if self._carry is None:  # what the committed state and the noted example ids are, once per change
            old = trainer.strategy
            ids = getattr(trainer, "ids", None)
            self._carry = (self._committed_state(old), list(getattr(ids, "pending", [])),
                           getattr(ids, "slice_index", None), self.membership.generation)
            trainer.ids = None  # (its notes are carried; a retried change must not write them twice)
        if trainer.strategy is not None:
            old = trainer.strategy
            trainer.strategy = s.strategy = s.model = None
            old.model = None  # DDP's reducer holds hooks on the parameters until it is freed
            del old  # (sync's exchange runs through the process group here: every rank is expendable)
        state, pending, old_index, old_generation = self._carry
        at = os.environ.get(JOIN_AT_ENV)
        generation = self.membership.change(self.committed, cut=failed,
                                            admit=at is None or self.committed >= int(at))
        # a sharded model is built again around a fresh copy (its old one is sharded over the old group)
        strategy = self._rebuild(self._healing.module() if self._healing is not None else None)
        self._receive_into(strategy, generation, state)
        self._carry = None
        self._keep(strategy)
        self._write_ids(pending, old_index, old_generation, generation)
        seconds = time.perf_counter() - started
        if trainer.topology.is_main and not run_log.enabled:  # the main rank was lost: this one reports now
            run_log.take_over(trainer.config.tracking, self.membership.tracker_runs(),
                              trainer.config.train.save_model)
        self._record(old_generation, generation, seconds, run_log)

    def _record(self, old_generation: Generation, generation: Generation, seconds: float, run_log: Any) -> None:
        """The change from ``old_generation`` (the last that trained, or the launch's) in the summary, the metrics
        file (once ``run_log`` is there: a change during the start-up is written when the run starts) and the
        console."""
        trainer = self.trainer
        lost, joined, gone = self.membership.settled(old_generation)  # (over every generation agreed since)
        record = {"step": self.session.start_step if run_log is None else generation.step,
                  "generation": generation.number, "workers": len(generation.slots),
                  "lost": lost, "joined": joined, **({"replacements_lost": gone} if gone else {}),
                  "seconds": round(seconds, 3)}
        self.changes.append(record)
        if trainer.topology.is_main:
            self.membership.note(record)
            if run_log is None:
                self._unwritten = record
            else:
                run_log._write({"event": "membership", **record, "unix_time": time.time()})
            what = []
            if lost:
                what.append(f"worker slot(s) {', '.join(map(str, lost))} lost")
            if old_generation.slots[0] in lost:
                what.append(f"worker slot {self.membership.slot} logs, evaluates and saves from here on")
            if joined:
                what.append(f"replacement(s) for slot(s) {', '.join(map(str, joined))} joined")
            if gone:
                what.append(f"replacement(s) for slot(s) {', '.join(map(str, gone))} lost before training")
            how = "nothing read from disk" if run_log is not None else "during the start-up: built again"
            get_logger().warning(f"{'; '.join(what) or 'membership renewed'}: going on with {len(generation.slots)} "
                                 f"workers from step {record['step']} (agreed and rebuilt in {seconds:.2f} s; {how})")

    def _rebuild(self, module: Any = None) -> Any:
        """This rank's strategy again, over the new generation's group, around the same module: built as at a
        start (:func:`~polytrain.train.session.make_strategy`, :func:`~polytrain.train.session.prepare_strategy`)."""
        from polytrain.train.session import make_strategy, prepare_strategy, run_lr

        s = self.session
        topology = self.membership.topology()
        layout = members_layout(self._cls, topology.world_size, self.membership.launched, self._options)
        self.membership.ready_to_build()  # (its mesh's groups wait for every member: a lost one is found first)
        strategy = make_strategy(s.config, topology, layout)
        lr = run_lr(s.config, s.plan.global_batch)
        prepare_strategy(strategy, module if module is not None else self._module, s.config, self._recipe, s.devices,
                         lr)
        self._use(strategy)
        return strategy

    def _use(self, strategy: Any) -> None:
        trainer, s = self.trainer, self.session
        trainers = strategy.trainers
        s.strategy, s.model, s.topology = strategy, strategy.model, strategy.topology
        s.slice = slice_of(trainers.rank, trainers.world_size, s.plan.global_batch)
        s.step_slices = s.slice
        trainer.strategy, trainer.topology = strategy, trainers
        trainer.stopping = trainer.stop.agreement(trainers.rank, trainers.world_size, trainers.timeout)
        trainer.timed.deciding = trainers.is_main  # --checkpoint-every-seconds: the main rank's clock
        if trainers.rank != self._speaking_as:  # the console as this rank's: the main one speaks
            setup_logging(trainers.rank, trainers.world_size, all_ranks=trainer.config.launch.log_all_ranks)
            self._speaking_as = trainers.rank
        self._wrap(strategy)

    def _receive_into(self, strategy: Any, generation: Generation, mine: dict[str, Any] | None = None) -> None:
        """Load the state to continue from: this rank's own, or (a replacement, a rank behind) the source's,
        broadcast over the new group; a sharded model's, put together from the members' shards."""
        trainers, slot = strategy.trainers, self.membership.slot
        if strategy.healing is not None:  # the whole state from the members' shards (train/heal.py)
            state = heal(trainers, generation.step, dict(generation.committed).get(slot), mine)
        elif generation.anyone_needs_state:
            sent = trainers.broadcast_object(mine if trainers.rank == generation.source() else None,
                                             generation.source())
            state = sent if generation.needs_state(slot) else mine
        else:
            state = mine
        assert state is not None
        strategy.load_state_dict(state)
        strategy.amp.load_state_dict(state)
        self.committed = generation.step
        self.session.start_step = generation.step
        self._remember(strategy)

    def _remember(self, strategy: Any) -> None:
        """What a rebuild needs of the strategy that goes away."""
        self._cls = type(strategy)
        self._options, self._recipe = strategy.options, strategy.recipe
        self._healing = strategy.healing  # a sharded model is built again around a fresh copy, not this one
        self._module = strategy.module if self._healing is None else None

    # -- --log-example-ids --------------------------------------------------------------------------------

    def _write_ids(self, pending: list[tuple[int, list[int]]], old_index: int | None,
                   old: Generation, new: Generation) -> None:
        """The steps noted since the last log point, committed ones only, with a lost worker's slices from the
        plan; a collective over the new group (a replacement takes part with nothing)."""
        if not self.trainer.config.data.log_example_ids:
            return
        trainers, plan = self.trainer.topology, self.session.plan
        kept = [(step, part) for step, part in pending if step < new.step]
        noted = trainers.all_gather_object((old_index, kept) if old_index is not None else (None, []))
        if not trainers.is_main:
            return
        by_step: dict[int, dict[int, list[int]]] = {}
        for index, steps in noted:
            for step, part in steps:
                by_step.setdefault(step, {})[index] = part
        lines = []
        for step in sorted(by_step):
            parts, everyone = by_step[step], plan.global_indices(step)
            unobserved = [i for i in range(len(old.slots)) if i not in parts]
            for i in unobserved:
                parts[i] = slice_of(i, len(old.slots), plan.global_batch).take(everyone).tolist()
            line = {"step": step + 1, "epoch": plan.position(step)[0],
                    "ids": [i for index in sorted(parts) for i in parts[index]]}
            if unobserved:
                line["unobserved"] = unobserved
            lines.append(json.dumps(line) + "\n")
        path = Path(self.trainer.config.data.log_example_ids)
        with open(path, "a") as fh:
            fh.writelines(lines)


def local_state(strategy: Any) -> dict[str, Any]:
    """This rank's model and optimizer state (diloco: with its anchor and outer optimizer) and its precision's
    (the loss scale), without a collective."""
    return {**strategy.local_state(), **strategy.amp.state_dict()}


def _clone(state: Any) -> Any:
    """A copy of ``state`` whose tensors are detached copies on their own device (a state_dict's tensors are the
    live ones)."""
    return copy_state(state, leaf=lambda tensor: tensor.detach().clone())


def attach(trainer: Any, membership: Membership | None) -> ElasticRun | None:
    """The trainer's :class:`ElasticRun` under ``--on-failure continue`` (None otherwise)."""
    if membership is None or not continuing(trainer.config):
        return None
    return ElasticRun(trainer, membership)
