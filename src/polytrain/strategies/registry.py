"""The strategies by name, and which class runs a run's degrees.

``register_strategy`` makes a class ``--strategy NAME``; ``get_strategy`` finds it (or imports
``package.module:Class``). Each of polytrain's own is declared first in a light module (its name, section,
traits and layout: :mod:`polytrain.strategies.declared`), which :func:`get_declared` finds without importing
the strategy's own module: the command line parses, plans and refuses with the declared classes alone. A strategy name stands for degrees (:mod:`polytrain.parallel.degrees`): the class
that runs them is the named one where it cuts a replica over every axis they cut, else the registered class of
the same exchange that does (:func:`runner_for`); the job's layout names it (``Layout.strategy``, the user's
name in ``Layout.named``), and :func:`strategy_class` finds it again in every process.
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

from polytrain.builtin_strategies import BUILTIN_STRATEGIES
from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.parallel.degrees import Degrees, fill_of, given_degrees, resolve
from polytrain.strategies.base import Strategy, layout_for
from polytrain.strategies.declared import DEFAULT_WORKERS, Declared


def degrees_of(cls: type[Declared], workers: int | None, options: Any = None) -> Degrees:
    """The degrees of ``--strategy cls.name`` for ``--workers`` (None: not given) and the degrees its options
    name (:mod:`polytrain.parallel.degrees`)."""
    traits = cls.traits
    given = {**traits.degrees, **{axis: size for axis, size in given_degrees(options).items() if size is not None}}
    return resolve(fill_of(traits.fills, options), workers, given, DEFAULT_WORKERS, cls.name)


def mesh_layout(cls: type[Declared], workers: int | None, options: Any = None, meets_every: int = 1) -> Layout:
    """The layout of a strategy of the mesh: one trainer rank per point of ``dp_replicate x dp_shard x pp x
    tp``, run by the class of its exchange that cuts a replica as the degrees say (:func:`runner_for`)."""
    return degrees_layout(cls, degrees_of(cls, workers, options), meets_every)


def degrees_layout(cls: type[Declared], degrees: Degrees, meets_every: int = 1) -> Layout:
    """The layout of ``degrees`` for ``--strategy cls.name`` (:func:`mesh_layout`'s, the degrees given)."""
    runner = runner_for(cls, degrees)
    return Layout(runner.name, ("trainer",) * degrees.world, degrees.axes(), degrees.dp, meets_every=meets_every,
                  named=cls.name if runner is not cls else "")


def runner_for(cls: type[Declared], degrees: Degrees) -> type[Declared]:
    """The class that runs ``degrees`` for ``--strategy cls.name``: ``cls`` where it cuts a replica over every
    axis the degrees cut, else the registered class of the same exchange that does with the fewest axes
    (``--strategy sync --dp-shard 4``: fsdp). One ConfigError line where none does."""
    cut, exchange = set(degrees.cut()), cls.traits.exchange
    if cut <= set(cls.traits.cuts):
        return cls
    found = [c for c in declared().values() if exchange and c.traits.exchange == exchange and cut <= set(c.traits.cuts)]
    if found:
        return min(found, key=lambda c: (len(c.traits.cuts), c.traits.fills is None, c.name))
    given = " ".join(f"--{a.replace('_', '-')} {getattr(degrees, a)}" for a in degrees.cut()
                     if a not in cls.traits.cuts)
    takes = ", ".join(f"--{a.replace('_', '-')}" for a in cls.traits.cuts) or "none: each replica whole on one rank"
    raise ConfigError(f"--strategy {cls.name} with {given}: not supported (the axes it cuts a replica over: "
                      f"{takes}); drop {given.split(' ')[0]}, or use --strategy sync for the degrees")


def strategy_class(config: Any, layout: Layout | None = None, processes: int | None = None) -> type[Strategy]:
    """The class that runs ``config``'s ``--strategy``: the one named, or the one the job's ``layout`` says runs
    its degrees (``sync --dp-shard 4``: fsdp); without a layout, the one that lays out ``processes``."""
    found = declared_class(config, layout, processes)
    return found if issubclass(found, Strategy) else get_strategy(found.name)


def declared_class(config: Any, layout: Layout | None = None, processes: int | None = None) -> type[Declared]:
    """What :func:`strategy_class` finds, as its declared class (a user's own class as it is): found without
    importing a strategy's module, for what the command line reads before launch."""
    from polytrain.strategies.settings import options_of

    named = get_declared(config.train.strategy)
    if layout is None and processes is not None:
        layout = layout_for(named, processes, options_of(config, named))
    if layout is not None and layout.named == named.name and layout.strategy != named.name:
        return get_declared(layout.strategy)
    return named


_REGISTRY: dict[str, type[Strategy]] = {}


#: where each of polytrain's own strategies is declared (:mod:`polytrain.strategies.declared`): light modules,
#: imported by the command line for every flag and key (:mod:`polytrain.components`)
BUILTIN_DECLARED = {
    "single": "polytrain.strategies.single_config",
    "sync": "polytrain.strategies.sync_config",
    "local-sgd": "polytrain.strategies.periodic_config",
    "diloco": "polytrain.strategies.periodic_config",
    "pipeline": "polytrain.parallel.pp.config",
    "hybrid": "polytrain.parallel.pp.config",
    "fsdp": "polytrain.parallel.fsdp_config",
    "tp": "polytrain.parallel.tp.config",
    "async": "polytrain.strategies.ps.config",
}
_DECLARED: dict[str, type[Declared]] = {}


def declare(cls: type[Declared]) -> type[Declared]:
    """Class decorator: ``cls`` declares polytrain's own ``--strategy cls.name`` (the strategy's class, in its
    module named in :data:`BUILTIN_STRATEGIES`, inherits it)."""
    if BUILTIN_DECLARED.get(cls.name) != cls.__module__:
        raise ValueError(f"{cls.__module__}.{cls.__qualname__}: only polytrain's own strategies are declared "
                         f"(BUILTIN_DECLARED); register a strategy class of your own with register_strategy")
    _DECLARED[cls.name] = cls
    return cls


def declared() -> dict[str, type[Declared]]:
    """Every strategy by name: polytrain's own as declared (no strategy module imported), the others' classes."""
    for module in dict.fromkeys(BUILTIN_DECLARED.values()):
        importlib.import_module(module)
    return {**_REGISTRY, **_DECLARED}


def get_declared(name: str) -> type[Declared]:
    """The strategy ``name`` as declared (polytrain's own: no strategy module imported), or the class registered
    or imported by that name (:func:`get_strategy`)."""
    if name in BUILTIN_DECLARED:
        importlib.import_module(BUILTIN_DECLARED[name])
        return _DECLARED[name]
    return get_strategy(name)


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` available as ``--strategy cls.name``; a name is taken once (polytrain's own
    names by their own modules, whether imported yet or not)."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty `name`")
    own = BUILTIN_STRATEGIES.get(cls.name)
    if own is not None and cls.__module__ != own:
        raise ValueError(f"strategy name '{cls.name}' is taken by {own} (polytrain's own); give "
                         f"{cls.__module__}.{cls.__qualname__} another name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        taken = _REGISTRY[cls.name]
        raise ValueError(f"strategy name '{cls.name}' is taken by {taken.__module__}.{taken.__qualname__}; "
                         f"give {cls.__module__}.{cls.__qualname__} another name")
    _REGISTRY[cls.name] = cls
    return cls


def available_strategies() -> list[str]:
    return sorted(set(_REGISTRY) | set(BUILTIN_STRATEGIES))


def get_strategy(name: str) -> type[Strategy]:
    """The strategy registered as ``name``, or the class ``package.module:Class`` (imported, so a strategy
    defined in your own module works in every spawned worker too)."""
    if ":" in name:
        return _import_strategy(name)
    if name not in _REGISTRY and name in BUILTIN_STRATEGIES:
        importlib.import_module(BUILTIN_STRATEGIES[name])
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, available_strategies(), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"--strategy: unknown strategy '{name}'{hint}; available: "
                          f"{', '.join(available_strategies())}, or package.module:Class") from None


def _import_strategy(spec: str) -> type[Strategy]:
    module_name, _, attr = spec.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--strategy {spec}: cannot import it ({exc})") from None
    if not (isinstance(found, type) and issubclass(found, Strategy)):
        raise ConfigError(f"--strategy {spec}: not a polytrain.Strategy subclass")
    return found
