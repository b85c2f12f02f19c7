"""A job's layout, decided once before anything starts: its processes, their roles and names, the named mesh
axes of the trainer ranks, the ranks it may lose, and how each global batch is cut.

A strategy computes it from ``--workers`` and its own settings (:meth:`Strategy.layout
<polytrain.strategies.base.Strategy.layout>`), in the launching process; the run's checks, the launcher
(how many processes, what each is called in an error, which may die), every rank's session and its
:class:`~polytrain.distributed.topology.Topology` read it, and ``polytrain plan`` prints it. Nothing asks a
strategy these questions again. It is plain data: frozen, printable, comparable, picklable.

Roles: a ``trainer`` rank runs the trainer's loop (steps, log points, evaluation, checkpoints); a ``server``
rank (a parameter server) and a ``helper`` rank (work handed out of step order) run a loop of their own,
which the strategy provides (:attr:`Strategy.own_loop <polytrain.strategies.base.Strategy.own_loop>`).

Axes, in mesh order over the trainer ranks: ``dp`` (data-parallel replicas: each takes its slice of the
global batch), ``pp`` (pipeline stages), ``tp`` (tensor-parallel ranks: each holds its part of the layers a
plan splits; innermost, so a replica's tp ranks are neighbours). ``shard`` (sharded data parallel) is a
reserved name, of size 1 so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


ROLES = ("trainer", "server", "helper")
AXES = ("dp", "pp", "tp")
RESERVED_AXES = ("shard",)  # named now, so that a layout's printout has one vocabulary; size 1 today


@dataclass(frozen=True)
class Layout:
    """``roles[r]`` and ``names[r]`` of each rank ``r``; ``axes``: (name, size) in mesh order over the trainer
    ranks (their sizes multiply to the number of trainers); ``slices``: how many slices each global batch is
    cut into (the data-parallel width: ``--worker-batch-size B`` means ``slices * B`` examples a step);
    ``expendable``: the ranks the job goes on without (``--tolerate-worker-loss``); ``meets_every``: the
    trainer ranks take part in a collective over all of them every this many steps (1: every step; 0: only at
    the trainer's own log points), where an orderly stop can be agreed (:mod:`polytrain.distributed.stop`)."""

    strategy: str
    roles: tuple[str, ...]
    axes: tuple[tuple[str, int], ...]
    slices: int
    names: tuple[str, ...] = ()
    expendable: tuple[int, ...] = ()
    meets_every: int = 1

    def __post_init__(self) -> None:
        if not self.roles or any(role not in ROLES for role in self.roles):
            raise ValueError(f"roles must be some of {', '.join(ROLES)}, got {self.roles}")
        if self.names and len(self.names) != len(self.roles):
            raise ValueError(f"{len(self.names)} names for {len(self.roles)} ranks")
        unknown = [name for name, _ in self.axes if name not in AXES + RESERVED_AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; known: {', '.join(AXES + RESERVED_AXES)}")
        product = 1
        for _, size in self.axes:
            product *= size
        if product != len(self.trainers):
            raise ValueError(f"axes {dict(self.axes)} hold {product} ranks, but {len(self.trainers)} train")
        if not 1 <= self.slices:
            raise ValueError(f"slices must be >= 1, got {self.slices}")
        if any(not 0 < rank < self.processes for rank in self.expendable):
            raise ValueError(f"expendable ranks {self.expendable} must be in 1..{self.processes - 1}")

    @classmethod
    def data_parallel(cls, strategy: str, workers: int, meets_every: int = 1) -> "Layout":
        """``workers`` trainer processes, each a data-parallel replica taking one slice of every batch."""
        return cls(strategy, ("trainer",) * workers, (("dp", workers),), workers, meets_every=meets_every)

    # -- what the launcher, the checks and the session read ----------------------------------------------

    @property
    def processes(self) -> int:
        return len(self.roles)

    @property
    def workers(self) -> int:
        """The ranks that compute steps' slices (all but the servers): what ``--straggler`` ranks count in."""
        return sum(role != "server" for role in self.roles)

    @property
    def trainers(self) -> tuple[int, ...]:
        """The ranks that run the trainer's loop (metrics, evaluation and checkpoints are theirs)."""
        return tuple(rank for rank, role in enumerate(self.roles) if role == "trainer")

    def axis(self, name: str) -> int:
        """The size of axis ``name`` (1 where the layout does not use it)."""
        if name not in AXES + RESERVED_AXES:
            raise ValueError(f"unknown axis '{name}'; known: {', '.join(AXES + RESERVED_AXES)}")
        return dict(self.axes).get(name, 1)

    def role(self, rank: int) -> str:
        return self.roles[rank]

    def name(self, rank: int) -> str:
        """What rank ``rank`` is called where its failure is reported."""
        return self.names[rank] if self.names else f"worker rank {rank}"

    def meets_at(self, step: int) -> bool:
        """Whether step ``step`` (counted from 1) holds a collective over every trainer rank."""
        return bool(self.meets_every) and step % self.meets_every == 0

    # -- printing ------------------------------------------------------------------------------------------

    def describe(self) -> str:
        """The layout as ``polytrain plan`` prints it: one line per rank, then the axes and the batch."""
        axes = " x ".join(f"{name} {size}" for name, size in self.axes) or "none"
        lines = [f"layout of --strategy {self.strategy}: {self.processes} process(es); mesh over the "
                 f"{len(self.trainers)} trainer rank(s): {axes}; each global batch in {self.slices} slice(s)"]
        coords = self._coordinates()
        for rank in range(self.processes):
            where = coords.get(rank, "")
            lost = "  (may be lost: the job goes on without it)" if rank in self.expendable else ""
            lines.append(f"  rank {rank}: {self.roles[rank]:<7} {self.name(rank)}{where}{lost}")
        meets = ("every step" if self.meets_every == 1 else f"every {self.meets_every} steps" if self.meets_every
                 else "at the trainer's log points")
        lines.append(f"  the trainer ranks meet {meets}")
        return "\n".join(lines)

    def _coordinates(self) -> dict[int, str]:
        """Each trainer rank's coordinates on the axes (mesh order: the last axis varies fastest)."""
        out = {}
        for index, rank in enumerate(self.trainers):
            parts, rest = [], index
            for name, size in reversed(self.axes):
                parts.append(f"{name} {rest % size}")
                rest //= size
            out[rank] = f"  [{', '.join(reversed(parts))}]" if self.axes else ""
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "processes": self.processes, "roles": list(self.roles),
                "names": [self.name(r) for r in range(self.processes)], "axes": dict(self.axes),
                "slices": self.slices, "expendable": list(self.expendable), "meets_every": self.meets_every}
