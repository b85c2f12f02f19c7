"""Degrees of one mesh: how many ranks each way of cutting the work spans, decided once before launch.

A job's trainer ranks form one mesh ``dp_replicate x dp_shard x pp x tp`` (outermost first; ``tp`` innermost,
so a replica's tensor-parallel ranks are neighbours):

* ``dp_replicate``: replicas of the model; they meet as the strategy says (``sync``: gradients averaged every
  step; ``local-sgd``, ``diloco``: parameters every H steps);
* ``dp_shard``: the ranks each replica's parameters, gradients and optimizer state are sharded over (FSDP2
  ``fully_shard``; HSDP where ``dp_replicate`` > 1);
* ``pp``: pipeline stages of each replica;
* ``tp``: tensor-parallel ranks each layer of the plan is split over (DTensor).

Every rank of one ``dp_replicate x dp_shard`` coordinate takes the same slice of each global batch: the batch
axis ``dp`` is the two together (``slices`` = dp_replicate x dp_shard). ``cp`` and ``ep`` (context and expert
parallel) are names kept for later, of size 1.

Flags: ``--dp-replicate``, ``--dp-shard``, ``--pp``, ``--tp`` (one flag per degree), and ``--workers`` for the
number of processes, which the degree a strategy name leaves open fills (``--strategy fsdp --workers 4`` is
``--dp-shard 4``). The strategy names ``sync``, ``fsdp``, ``tp``, ``pipeline`` and ``hybrid`` are names for
common degree settings (:data:`MEANING`); the model is then cut by the functions of :data:`ORDER`, in that order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Iterable

from polytrain.errors import ConfigError
from polytrain.options import option, register_section

#: the degrees, in mesh order (outermost first)
AXES = ("dp_replicate", "dp_shard", "pp", "tp")
#: named for later (context and expert parallel), of size 1 today
RESERVED = ("cp", "ep")
#: how the model is prepared, in this order, each step applied to what the one before produced (a degree of 1
#: skips its step); the last is the strategy's: how the replicas meet
ORDER = (
    ("ac", "activation checkpointing (--activation-checkpointing)"),
    ("compile", "each unit compiled (--compile)"),
    ("pp", "cut into stages (a chain of units, or by the tracer)"),
    ("tp", "the --tp-plan's layers split over tp (DTensor, parallelize_module)"),
    ("dp_shard", "fully_shard over dp_shard (HSDP over dp_replicate x dp_shard where both > 1)"),
    ("dp_replicate", "the replicas meet as the strategy says"),
)


@register_section("parallel", "degrees of one mesh: dp_replicate x dp_shard x pp x tp (polytrain plan prints "
                              "each rank's coordinates)", order=61)
@dataclass
class DegreesConfig:
    dp_replicate: int | None = option(None, "replicas of the model, each a slice of every batch; they meet as "
                                            "--strategy says (sync: gradients averaged every step). Default: "
                                            "what --workers leaves", minimum=1, metavar="R")
    dp_shard: int | None = option(None, "ranks each replica's parameters, gradients and optimizer state are "
                                        "sharded over (FSDP2 fully_shard; HSDP with --dp-replicate > 1), each a "
                                        "slice of every batch (--strategy fsdp: all of --workers)", minimum=1,
                                  metavar="S")
    pp: int | None = option(None, "pipeline stages of each replica, one rank each, micro-batched by --schedule "
                                  "(--strategy pipeline, hybrid: 2 by default)", minimum=1, metavar="P")
    tp: int | None = option(None, "tensor-parallel ranks each layer of --tp-plan is split over (Megatron-style, "
                                  "DTensor) (--strategy tp: all of --workers by default)", minimum=1, metavar="T")


@dataclass(frozen=True)
class Degrees:
    """The size of each axis of the mesh (1: not cut that way)."""

    dp_replicate: int = 1
    dp_shard: int = 1
    pp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in AXES:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, sizes: Iterable[tuple[str, int]]) -> "Degrees":
        """From a layout's ``(axis, size)`` pairs (axes not named: 1)."""
        return cls(**{name: int(size) for name, size in sizes if name in AXES})

    @property
    def world(self) -> int:
        """The ranks the mesh holds: the product of the degrees."""
        return math.prod(getattr(self, name) for name in AXES)

    @property
    def dp(self) -> int:
        """The batch axis: dp_replicate x dp_shard ranks, each taking its own slice of every global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def replica(self) -> int:
        """The ranks one replica is cut over: dp_shard x pp x tp."""
        return self.dp_shard * self.pp * self.tp

    def cut(self) -> tuple[str, ...]:
        """The axes over which one replica is cut (those of size > 1 besides dp_replicate)."""
        return tuple(name for name in AXES[1:] if getattr(self, name) > 1)

    def axes(self) -> tuple[tuple[str, int], ...]:
        """The mesh's axes, in order: dp_replicate always, the others where larger than 1."""
        return tuple((name, getattr(self, name)) for name in AXES if name == "dp_replicate" or getattr(self, name) > 1)

    def coordinates(self, index: int) -> dict[str, int]:
        """Trainer rank ``index``'s coordinate on every axis (the last axis varies fastest)."""
        out, rest = {}, index
        for name in reversed(AXES):
            size = getattr(self, name)
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in AXES}

    def flags(self) -> str:
        """The flags that give these degrees: ``--dp-shard 2 --tp 2``."""
        given = [f"--{name.replace('_', '-')} {getattr(self, name)}" for name in AXES if getattr(self, name) > 1]
        return " ".join(given) or "--dp-replicate 1"

    def describe(self) -> str:
        """``dp_replicate 2 x dp_shard 2`` (the axes larger than 1; ``dp_replicate 1`` for one process)."""
        return " x ".join(f"{name} {size}" for name, size in self.axes() if size > 1) or "dp_replicate 1"

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def product_line(sizes: dict[str, int]) -> str:
    """``--dp-shard 2 x --tp 2 = 4``: the given degrees and their product."""
    names = " x ".join(f"--{name.replace('_', '-')} {size}" for name, size in sizes.items())
    return f"{names} = {math.prod(sizes.values())}"


def resolve(fills: str | None, workers: int | None, given: dict[str, int | None], default_workers: int,
            name: str) -> Degrees:
    """The degrees of ``--strategy name``: those ``given``, and the degree ``fills`` (None: none) taking what
    ``--workers`` leaves (``dp_replicate`` where ``fills`` is given too). Without ``--workers``:
    ``default_workers`` processes where no degree is given, else one replica. One ConfigError line where the
    given degrees do not fill ``--workers``."""
    sizes = {axis: int(size) for axis in AXES if (size := given.get(axis)) is not None}
    if fills is not None:
        target = fills if fills not in sizes else "dp_replicate"
        if target not in sizes:
            fixed = math.prod(sizes.values())
            if workers is None:
                sizes[target] = max(1, default_workers // fixed) if not sizes else 1
            elif workers % fixed:
                raise ConfigError(f"--strategy {name}: --workers {workers} is not a multiple of "
                                  f"{product_line(sizes)}; pass --workers {max(1, workers // fixed) * fixed} (the "
                                  f"rest of --workers becomes --{target.replace('_', '-')})")
            else:
                sizes[target] = workers // fixed
    degrees = Degrees(**sizes)
    if fills is not None and workers is not None and degrees.world != workers:
        raise ConfigError(f"--strategy {name}: {product_line({a: getattr(degrees, a) for a in AXES if a in sizes})} "
                          f"processes, but --workers is {workers}; pass --workers {degrees.world}, or degrees "
                          f"whose product is {workers}")
    return degrees


def given_degrees(options: Any) -> dict[str, int | None]:
    """The degrees a strategy's options name (``--dp-replicate`` ... ``--tp``; None where not given), the
    deprecated second names of a pipeline's options read as theirs: ``--stages`` is ``--pp``, ``--dp`` is
    ``--dp-replicate`` (``--dp-shard`` with ``--shard-dp``). One line where a second name and its flag differ."""
    given = {axis: getattr(options, axis, None) for axis in AXES}
    sharded = bool(getattr(options, "shard_dp", False))
    for old, axis, value in (("--stages", "pp", getattr(options, "stages", None)),
                             ("--dp", "dp_shard" if sharded else "dp_replicate", getattr(options, "dp", None))):
        if value is None:
            continue
        if given[axis] is not None and given[axis] != value:
            raise ConfigError(f"{old} {value} and --{axis.replace('_', '-')} {given[axis]} name the same degree; "
                              f"give --{axis.replace('_', '-')} only")
        given[axis] = value
    return given


def fill_of(fills: str | None, options: Any) -> str | None:
    """The degree ``--workers`` fills: ``fills``, or dp_shard for the replicas of the deprecated ``--shard-dp``."""
    return "dp_shard" if fills == "dp_replicate" and getattr(options, "shard_dp", False) else fills


def meaning(name: str, degrees: Degrees) -> str:
    """What ``--strategy name`` stands for here: ``--strategy fsdp = --dp-shard 4``."""
    return f"--strategy {name} = {degrees.flags()}"


def deprecated_flags(config: Any) -> list[str]:
    """A line for each second name of a degree that ``config`` sets, saying the flag it stands for: ``--stages``
    (``--pp``), hybrid's ``--dp`` (``--dp-replicate``, or ``--dp-shard`` with ``--shard-dp``), ``--shard-dp``."""
    pipeline = getattr(config, "pipeline", None)
    if pipeline is None:
        return []
    out = []
    if pipeline.stages is not None:
        out.append(f"--stages {pipeline.stages} is deprecated: it is --pp {pipeline.stages} (one flag per degree); "
                   "--stages still works for now")
    if pipeline.dp is not None:
        axis = "--dp-shard" if pipeline.shard_dp else "--dp-replicate"
        out.append(f"--dp {pipeline.dp}{' --shard-dp' if pipeline.shard_dp else ''} is deprecated: it is {axis} "
                   f"{pipeline.dp} (one flag per degree); it still works for now")
    elif pipeline.shard_dp:
        out.append("--shard-dp is deprecated: --dp-shard D shards each stage over D ranks (one flag per degree); "
                   "it still works for now")
    return out


def order(sizes: dict[str, int], meeting: str, units: Any = None) -> list[str]:
    """How one replica is made, in order (:data:`ORDER`), for the degrees ``sizes`` and the ``--activation-
    checkpointing``/``--compile`` settings in ``units`` (None: not asked); the last line, how the replicas meet."""
    steps = []
    for axis, what in ORDER:
        size = sizes.get(axis, 1)
        if axis == "ac" and getattr(units, "activation_checkpointing", "off") != "off":
            steps.append(f"{what}: {units.activation_checkpointing}")
        elif axis == "compile" and getattr(units, "compile", False):
            steps.append(what)
        elif axis == "dp_replicate":
            steps.append(f"{size} replica(s) meet: {meeting}" if size > 1 else f"one replica ({meeting} with none)")
        elif size > 1:
            steps.append(f"{axis} {size}: {what}")
    return [f"  {i}. {step}" for i, step in enumerate(steps, 1)]
