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

Axes, in mesh order over the trainer ranks (the degrees of :mod:`polytrain.parallel.degrees`):
``dp_replicate`` (replicas of the model, which meet as the strategy says), ``dp_shard`` (the ranks each replica's
state is sharded over), ``pp`` (pipeline stages) and ``tp`` (tensor-parallel ranks; innermost, so a replica's
tp ranks are neighbours). ``dp`` is the batch axis, dp_replicate x dp_shard: every rank of one coordinate on
it takes the same slice of each global batch. A layout names ``dp_replicate`` and the axes larger than 1;
``dp`` given when a layout is made stands for ``dp_replicate`` (a strategy of one's own). ``cp`` and ``ep``
(context and expert parallel) are reserved names, of size 1 so far.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


ROLES = ("trainer", "server", "helper")
#: the mesh's axes, outermost first
AXES = ("dp_replicate", "dp_shard", "pp", "tp")
#: the batch axis: dp_replicate x dp_shard
BATCH = "dp"
RESERVED_AXES = ("cp", "ep")  # named now, so that a layout's printout has one vocabulary; size 1 today


@dataclass(frozen=True)
class Layout:
    """``roles[r]`` and ``names[r]`` of each rank ``r``; ``axes``: (name, size) in mesh order over the trainer
    ranks (their sizes multiply to the number of trainers); ``slices``: how many slices each global batch is
    cut into (the data-parallel width: ``--worker-batch-size B`` means ``slices * B`` examples a step);
    ``expendable``: the ranks the job goes on without (``--tolerate-worker-loss``: never rank 0; ``--on-failure
    continue``: every rank); ``meets_every``: the
    trainer ranks take part in a collective over all of them every this many steps (1: every step; 0: only at
    the trainer's own log points), where an orderly stop can be agreed (:mod:`polytrain.distributed.stop`)."""

    strategy: str
    roles: tuple[str, ...]
    axes: tuple[tuple[str, int], ...]
    slices: int
    names: tuple[str, ...] = ()
    expendable: tuple[int, ...] = ()
    meets_every: int = 1
    #: the ``--strategy`` the user named, where another class runs its degrees (``sync --dp-shard 4``: fsdp)
    named: str = ""

    def __post_init__(self) -> None:
        if any(name == BATCH for name, _ in self.axes):  # "dp": a strategy of one's own, of whole replicas
            object.__setattr__(self, "axes", tuple(("dp_replicate" if n == BATCH else n, s) for n, s in self.axes))
        if not self.roles or any(role not in ROLES for role in self.roles):
            raise ValueError(f"roles must be some of {', '.join(ROLES)}, got {self.roles}")
        if self.names and len(self.names) != len(self.roles):
            raise ValueError(f"{len(self.names)} names for {len(self.roles)} ranks")
        unknown = [name for name, _ in self.axes if name not in AXES + RESERVED_AXES]
        if unknown:
            raise ValueError(f"unknown axes {unknown}; known: {', '.join(AXES + RESERVED_AXES)}")
        order = [name for name, _ in self.axes]
        if order != sorted(order, key=(AXES + RESERVED_AXES).index):
            raise ValueError(f"axes {order} are not in mesh order ({', '.join(AXES)})")
        product = 1
        for _, size in self.axes:
            product *= size
        if product != len(self.trainers):
            raise ValueError(f"axes {dict(self.axes)} hold {product} ranks, but {len(self.trainers)} train")
        if not 1 <= self.slices:
            raise ValueError(f"slices must be >= 1, got {self.slices}")
        if any(not 0 <= rank < self.processes for rank in self.expendable):
            raise ValueError(f"expendable ranks {self.expendable} must be in 0..{self.processes - 1}")

    @classmethod
    def data_parallel(cls, strategy: str, workers: int, meets_every: int = 1) -> "Layout":
        """``workers`` trainer processes, each a data-parallel replica taking one slice of every batch."""
        return cls(strategy, ("trainer",) * workers, (("dp_replicate", workers),), workers, meets_every=meets_every)

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
        """The size of axis ``name`` (1 where the layout does not use it); ``dp``: dp_replicate x dp_shard."""
        if name == BATCH:
            return self.axis("dp_replicate") * self.axis("dp_shard")
        if name not in AXES + RESERVED_AXES:
            raise ValueError(f"unknown axis '{name}'; known: {', '.join(AXES + RESERVED_AXES)}, {BATCH}")
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
        named = f"{self.named or self.strategy} ({self.flags()}" + (f"; run by {self.strategy})" if self.named else ")")
        lines = [f"layout of --strategy {named}: {self.processes} process(es); mesh over the "
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

    def flags(self) -> str:
        """The degrees as the flags that give them: ``--dp-shard 2 --tp 2`` (``--dp-replicate N`` of whole
        replicas)."""
        sizes = [(name, size) for name, size in self.axes if size > 1] or list(self.axes[:1])
        return " ".join(f"--{name.replace('_', '-')} {size}" for name, size in sizes)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Trainer rank ``rank``'s coordinate on each axis of the layout (mesh order: the last axis varies
        fastest), and on the batch axis ``dp``; empty for a rank that does not train."""
        if rank not in self.trainers:
            return {}
        out, rest = {}, self.trainers.index(rank)
        for name, size in reversed(self.axes):
            out[name] = rest % size
            rest //= size
        coords = {name: out[name] for name, _ in self.axes}
        coords[BATCH] = coords.get("dp_replicate", 0) * self.axis("dp_shard") + coords.get("dp_shard", 0)
        return coords

    def _coordinates(self) -> dict[int, str]:
        """Each trainer rank's coordinates on the axes, as printed."""
        out = {}
        for rank in self.trainers:
            coords = self.coordinates(rank)
            out[rank] = f"  [{', '.join(f'{name} {coords[name]}' for name, _ in self.axes)}]" if self.axes else ""
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "processes": self.processes, "roles": list(self.roles),
                "names": [self.name(r) for r in range(self.processes)], "axes": dict(self.axes),
                "slices": self.slices, "expendable": list(self.expendable), "meets_every": self.meets_every,
                **({"named": self.named} if self.named else {})}
