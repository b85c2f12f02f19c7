"""A model that is never whole on a rank that does not need it: built on the meta device (shapes only, no
memory), then materialised one unit at a time, each rank keeping only what it trains.

A model takes part when its class defines ``init_unit(name, unit)``: it initialises the parameters and
buffers of one unit (a top-level child, a ``ModuleList`` flattened: ``blocks.0``, ``blocks.1``, ...; see
:func:`polytrain.models.parts.units`) in place, drawing only from torch's default generator.
:func:`materialize` seeds that generator per unit from the run's seed and the unit's name, so a unit's initial
values depend on nothing else: every strategy, whatever it keeps and in whatever order it builds, starts
from the same values as ``single`` (which materialises every unit the same way). :class:`UnitInit` gives the
default (every sub-module's ``reset_parameters()``); the built-in models use it or their own.

A factory whose model cannot be built on the meta device, or whose class has no ``init_unit``, is built whole
as before (a strategy that shards or cuts the model warns what that costs). So is one that gives its model
weights of its own while it builds it (loads a file, sets values after constructing it: found by
:mod:`polytrain.models.probe`): a model's weights are the user's, and only a model that arrives with nothing
but its initialisation is initialised from the seed. :func:`build_for_run` makes that choice and says which.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from polytrain.models.parts import units
from polytrain.models.probe import Writes, build_on_meta

_SEED_ATTR = "_polytrain_init_seed"
_WRITES_ATTR = "_polytrain_factory_writes"  # on a model built whole: what its factory gave it of its own


class UnitInit:
    """Mixin: ``init_unit`` by every sub-module's own ``reset_parameters()`` (torch's default init)."""

    def init_unit(self, name: str, unit: nn.Module) -> None:
        for module in unit.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()


class UnitSequential(UnitInit, nn.Sequential):
    """An ``nn.Sequential`` whose units are initialised as torch initialises each layer (``mlp``, the CNNs)."""


def build_deferred(build: Callable[[], nn.Module], seed: int) -> nn.Module | None:
    """``build()`` on the meta device, if the model it gives can be materialised unit by unit and the factory
    gives it no weights of its own (None: build it whole instead)."""
    return probe_factory(build, seed)[0]


def probe_factory(build: Callable[[], nn.Module], seed: int) -> tuple[nn.Module | None, Writes | None]:
    """(``build()`` on the meta device waiting to be materialised from ``seed``, or None: build it whole; what
    the factory wrote into its tensors of its own, or None where it cannot be built on the meta device)."""
    try:
        model, writes = build_on_meta(build)
    except Exception:  # noqa: BLE001 - a factory that computes with its tensors while building: not on meta
        return None, None
    if writes or not isinstance(model, nn.Module) or not deferrable(model):
        return None, writes
    setattr(model, _SEED_ATTR, int(seed))
    return model, writes


def build_for_run(build: Callable[[], nn.Module], seed: int,
                  parts: Callable[[Callable[[], nn.Module]], nn.Module | None] | None = None) -> tuple[nn.Module, str]:
    """The model a run starts from, and where its weights come from (the start-up line says it): on the meta
    device, initialised from ``seed`` unit by unit, where the factory gives it nothing but its initialisation
    and its class has ``init_unit``; else ``parts(build)`` (a strategy that makes only its part of any
    factory's model, with the factory's own values), else built whole, as the factory makes it."""
    deferred, writes = probe_factory(build, seed)
    if deferred is not None:
        return deferred, f"initialised from --seed {seed}"
    model = parts(build) if parts is not None else None
    if model is None:
        model = build()
        if writes:
            setattr(model, _WRITES_ATTR, writes)
    if writes:
        return model, f"weights from the factory (it {writes.describe()})"
    if writes is None:
        return model, "weights from the factory"
    return model, f"weights from the factory (its own initialisation, drawn from --seed {seed})"


def deferrable(model: nn.Module) -> bool:
    """Whether ``model`` initialises by units (``init_unit``) and holds nothing outside them."""
    if not callable(getattr(model, "init_unit", None)):
        return False
    own = list(model.named_parameters(recurse=False)) + list(model.named_buffers(recurse=False))
    seen: set[int] = set()
    for _, unit in units(model):  # a tensor shared by two units (tied weights) would come apart
        ids = {id(t) for t in _tensors(unit)}
        if ids & seen:
            return False
        seen |= ids
    return not own and bool(seen)


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device and waits to be materialised."""
    return hasattr(model, _SEED_ATTR) and any(t.is_meta for t in _tensors(model))


def unit_seed(seed: int, name: str) -> int:
    """The generator seed of unit ``name`` in a run of ``seed``: stable across processes and Python versions."""
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def materialize(model: nn.Module, device: torch.device | str = "cpu", *, keep: Callable[[str], bool] | None = None,
                then: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """Materialise ``model``'s units in order on ``device``, each with the values :func:`unit_seed` gives, one at
    a time: ``then(name, unit)`` runs right after each (to shard it, say) before the next is made; units that
    ``keep`` refuses stay on the meta device. The caller's random state is left as it was."""
    seed, peak = getattr(model, _SEED_ATTR), 0
    with torch.random.fork_rng(devices=[]):
        for name, unit in units(model):
            if keep is not None and not keep(name):
                continue
            unit.to_empty(device=device)
            torch.manual_seed(unit_seed(seed, name))
            with torch.no_grad():
                model.init_unit(name, unit)
            peak = max(peak, held_bytes(model))  # this unit whole, the ones before as kept
            if then is not None:
                then(name, unit)
    model.materialized_peak_bytes = peak  # the most it held while being made (what a test checks)
    return model


def held_bytes(model: nn.Module) -> int:
    """The bytes of parameters and buffers this process holds of ``model``: its own shards, nothing of
    what is still on the meta device."""
    total = 0
    for tensor in _tensors(model):
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if not local.is_meta:
            total += local.numel() * local.element_size()
    return total


def materialize_all(model: nn.Module, device: torch.device | str = "cpu") -> nn.Module:
    """The whole model (``single``'s), if it was built on the meta device; ``model`` unchanged otherwise."""
    return materialize(model, device) if is_deferred(model) else model


def unit_bytes(model: nn.Module) -> dict[str, int]:
    """Each unit's parameter and buffer bytes, whole (for a plan, or to tell what building whole costs)."""
    return {name: sum(t.numel() * t.element_size() for t in _tensors(unit)) for name, unit in units(model)}


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def describe_whole_build(model: nn.Module, spec: Any) -> str:
    """The warning for a model built whole where a strategy would keep a part: what it costs, and what to do."""
    total = sum(unit_bytes(model).values()) or sum(t.numel() * t.element_size() for t in _tensors(model))
    whole = f"every rank builds it whole ({total / 2**20:.1f} MiB of parameters and buffers) before this strategy " \
            "keeps its part"
    writes = getattr(model, _WRITES_ATTR, None)
    if writes:
        return (f"--model {spec}: its factory {writes.describe()} while it builds the model, so {whole} (the "
                "weights are kept); only a factory that builds without weights of its own, of a class with an "
                "init_unit(name, unit) method (polytrain.models.deferred), lets each rank make only its part")
    return (f"--model {spec} is built whole on every rank ({total / 2**20:.1f} MiB of parameters and buffers) before "
            "this strategy keeps its part: give the model's class an init_unit(name, unit) method "
            "(polytrain.models.deferred) so that it is built on the meta device and each rank materialises only "
            "its part")
