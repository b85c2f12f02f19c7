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
from polytrain.weights.fill import check_fits, fill, local_of
from polytrain.weights.sources import Source

_SEED_ATTR = "_polytrain_init_seed"
_WRITES_ATTR = "_polytrain_factory_writes"  # on a model built whole: what its factory gave it of its own
_SOURCE_ATTR = "_polytrain_weights"  # on a deferred model: the weights its units are filled from


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
                  parts: Callable[[Callable[[], nn.Module]], nn.Module | None] | None = None,
                  source: Source | None = None) -> tuple[nn.Module, str]:
    """The model a run starts from, and where its weights come from (the start-up line says it): on the meta
    device, initialised from ``seed`` unit by unit, where the factory gives it nothing but its initialisation
    and its class has ``init_unit``; else ``parts(build)`` (a strategy that makes only its part of any
    factory's model, with the factory's own values), else built whole, as the factory makes it. Given
    ``source`` (``--init-from``), the weights are its: checked to fit, and filled unit by unit as each rank
    makes its part, or into the whole model where it cannot be made by units."""
    if source is not None:
        return _build_from(build, seed, source), f"weights from {source.where}"
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


def _build_from(build: Callable[[], nn.Module], seed: int, source: Source) -> nn.Module:
    try:
        model, _ = build_on_meta(build)  # (what the factory loads itself gives way to the weights asked for)
    except Exception:  # noqa: BLE001 - a factory that computes with its tensors while building: built whole
        model = None
    if isinstance(model, nn.Module) and deferrable(model):
        check_fits(model, source)
        setattr(model, _SEED_ATTR, int(seed))
        return attach_weights(model, source)
    model = build()
    check_fits(model, source)
    fill(model, source)
    return model


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
                then: Callable[[str, nn.Module], None] | None = None,
                before: Callable[[str, nn.Module], None] | None = None) -> nn.Module:
    """Materialise ``model``'s units in order on ``device``, each with the values :func:`unit_seed` gives (or,
    given weights to start from, :func:`weights_of`, the weights' values), one at a time: ``then(name,
    unit)`` runs right after each (to shard it, say) before the next is made; units that ``keep`` refuses stay
    on the meta device. ``before(name, unit)``, given weights: shards or splits the unit while it is still on
    the meta device, so that each rank then reads only the block of each tensor it holds. The caller's random
    state is left as it was."""
    seed, peak, source = getattr(model, _SEED_ATTR), 0, weights_of(model)
    with torch.random.fork_rng(devices=[]):
        for name, unit in units(model):
            if keep is not None and not keep(name):
                continue
            if source is not None:
                _make_from(model, name, unit, device, source, before)
            else:
                unit.to_empty(device=device)
                torch.manual_seed(unit_seed(seed, name))
                with torch.no_grad():
                    model.init_unit(name, unit)
            peak = max(peak, held_bytes(model))  # this unit whole (or its block), the ones before as kept
            if then is not None:
                then(name, unit)
    model.materialized_peak_bytes = peak  # the most it held while being made (what a test checks)
    return model


def _make_from(model: nn.Module, name: str, unit: nn.Module, device: torch.device | str, source: Source,
               before: Callable[[str, nn.Module], None] | None) -> None:
    """Unit ``name`` made from weights: its buffers made and ``init_unit`` run while its parameters are still on
    the meta device (what it computes of the buffers, a rotary ``inv_freq`` that no file holds, is kept; what
    it writes into parameters costs nothing), (sharded on the meta device,) then its parameters made and
    every tensor the weights hold filled, each rank reading only its block."""
    buffers = [(m, key, b) for m in unit.modules() for key, b in m._buffers.items() if b is not None]
    for module, key, buffer in buffers:
        module._buffers[key] = torch.empty_like(buffer, device=device)
    torch.manual_seed(unit_seed(getattr(model, _SEED_ATTR), name))
    with torch.no_grad():
        try:
            model.init_unit(name, unit)
            initialised = True
        except Exception:  # noqa: BLE001 - it computes with its parameters' values: run it once they exist
            initialised = False
        if before is not None:
            before(name, unit)
        made = [(m, key, m._buffers[key]) for m, key, _ in buffers]
        unit.to_empty(device=device)
        for module, key, buffer in made:  # (to_empty empties every tensor: the buffers made above are kept)
            module._buffers[key] = buffer
        if not initialised:
            model.init_unit(name, unit)
    fill(unit, source, prefix=f"{name}.")


def attach_weights(model: nn.Module, source: Source) -> nn.Module:
    """Have :func:`materialize` fill ``model``'s units from ``source`` instead of initialising them."""
    setattr(model, _SOURCE_ATTR, source)
    return model


def weights_of(model: nn.Module) -> Source | None:
    """The weights a deferred model's units are filled from (None: initialised from the seed)."""
    return getattr(model, _SOURCE_ATTR, None)


def held_bytes(model: nn.Module) -> int:
    """The bytes of parameters and buffers this process holds of ``model``: its own shards, nothing of
    what is still on the meta device."""
    total = 0
    for tensor in _tensors(model):
        local = local_of(tensor)
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
                "weights are kept); to have each rank make and read only its part, build the model without them "
                "(a class with an init_unit(name, unit) method, polytrain.models.deferred) and give the weights as "
                "--init-from PATH")
    return (f"--model {spec} is built whole on every rank ({total / 2**20:.1f} MiB of parameters and buffers) before "
            "this strategy keeps its part: give the model's class an init_unit(name, unit) method "
            "(polytrain.models.deferred) so that it is built on the meta device and each rank materialises only "
            "its part")
