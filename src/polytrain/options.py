"""Typed config fields shared by every component's dataclass config, and the registry of config sections.

Each component (trainer, optimizer, checkpoints, launcher, a strategy, ...) declares its settings as a
dataclass whose fields are made with :func:`option`, and registers it as a section with
:func:`register_section` next to the component. The field's name is its TOML key and, with dashes, its
CLI flag, so ``batch_size = 64`` in a config file and ``--batch-size 64`` mean the same thing.
``polytrain.config`` collects the registered sections, builds the argument parser and merges
defaults < config file < flags; adding a component edits no central file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from polytrain.errors import ConfigError
from polytrain.specs import parse_assignments


def option(
    default: Any,
    help: str | Callable[[], str],
    *,
    choices: Sequence[str] | None = None,
    minimum: float | None = None,
    metavar: str | None = None,
    repeat: bool = False,
    check: Callable[[Any], None] | None = None,
    short: str | None = None,
    flag: str | None = None,
    finite: bool = True,
    strategies: Sequence[str] | None = None,
    elsewhere: str | None = None,
) -> Any:
    """A config field with its CLI help. ``check(value)`` raises ValueError with a message on bad values.
    A float must be finite unless ``finite=False``: nan passes every ``minimum`` comparison.

    In a strategy's section, ``strategies`` narrows who reads the field (default: every strategy of that
    section), and ``elsewhere`` is what a strategy of the section that does not read it is told, a template
    with ``{flags}`` (its flags), ``{given}`` (with their values), ``{verb}`` (sets/set), ``{strategy}`` and
    ``{them}`` (it/them) (:mod:`polytrain.strategies.settings`)."""
    meta = {
        "help": help, "choices": tuple(choices) if choices else None, "minimum": minimum,
        "metavar": metavar, "repeat": repeat, "check": check, "short": short, "flag": flag, "finite": finite,
        "strategies": tuple(strategies) if strategies else None, "elsewhere": elsewhere,
    }
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Section:
    """A registered config section: ``RunConfig.<name>`` holds a ``cls()``; ``title`` heads its --help group."""

    name: str
    cls: type
    title: str
    order: int


_SECTIONS: dict[str, Section] = {}


def register_section(name: str, title: str, *, order: int = 50) -> Callable[[type], type]:
    """Class decorator for a component's config dataclass: its fields become settings of every run, in
    section ``name`` (sections are listed by ``order``, then name). A name is taken once."""

    def register(cls: type) -> type:
        taken = _SECTIONS.get(name)
        if taken is not None and taken.cls.__qualname__ != cls.__qualname__:
            raise ValueError(f"config section '{name}' is taken by {taken.cls.__module__}.{taken.cls.__qualname__}")
        _SECTIONS[name] = Section(name, cls, title, order)
        return cls

    return register


def section_defaults(name: str) -> Any:
    """A fresh instance of section ``name``'s dataclass, with every default (None: no such section)."""
    section = _SECTIONS.get(name)
    return section.cls() if section is not None else None


def registered_sections() -> list[Section]:
    return sorted(_SECTIONS.values(), key=lambda s: (s.order, s.name))


@dataclass(frozen=True)
class OptionInfo:
    """One setting: its key, flag, type and the dataclass section it lives in."""

    key: str
    section: str
    type: str
    default: Any
    meta: dict[str, Any]

    @property
    def flag(self) -> str:
        return self.meta.get("flag") or "--" + self.key.replace("_", "-")

    @property
    def help(self) -> str:
        """The help text; a callable ``help`` is asked each time (e.g. the registered strategies)."""
        text = self.meta["help"]
        return text() if callable(text) else text


def describe(value: Any) -> str:
    return f"'{value}'" if isinstance(value, str) else repr(value)


def convert(info: OptionInfo, value: Any, source: str) -> Any:
    """Convert a flag string or TOML value to the field's type and check it; errors name ``source``."""
    try:
        typed = _coerce(info.type, value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    meta = info.meta
    if isinstance(typed, float) and not math.isfinite(typed) and meta.get("finite", True):
        raise ConfigError(f"{source}: must be a finite number, got {describe(typed)}")
    if typed is not None and meta["choices"] and typed not in meta["choices"]:
        raise ConfigError(f"{source}: unknown value {describe(typed)}; accepted: {', '.join(meta['choices'])}")
    if typed is not None and meta["minimum"] is not None and typed < meta["minimum"]:
        bound = int(meta["minimum"]) if float(meta["minimum"]).is_integer() else meta["minimum"]
        raise ConfigError(f"{source}: must be >= {bound}, got {describe(typed)}")
    if typed is not None and meta["check"] is not None:
        try:
            meta["check"](typed)
        except ValueError as exc:
            raise ConfigError(f"{source}: {exc}") from None
    return typed


def _coerce(kind: str, value: Any) -> Any:
    optional = kind.endswith("| None")
    base = kind.replace("| None", "").strip()
    if optional and (value is None or (isinstance(value, str) and value.strip().lower() in ("", "none"))):
        return None
    if base == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ValueError(f"expected true or false, got {describe(value)}")
    if base == "int":
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected an integer, got {describe(value)}")
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected an integer, got {describe(value)}") from None
    if base == "float":
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {describe(value)}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"expected a number, got {describe(value)}") from None
    if base == "str":
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ValueError(f"expected a string, got {describe(value)}")
        return str(value)
    if base.startswith("list"):
        items = value if isinstance(value, list) else [value]
        return [str(v) for v in items]
    if base.startswith("dict"):
        if isinstance(value, dict):
            return dict(value)
        if isinstance(value, list):  # repeated --flag key=value
            return parse_assignments([str(v) for v in value])
        raise ValueError(f"expected a table of key = value, got {describe(value)}")
    raise TypeError(f"unsupported option type {kind}")  # a bug in a config dataclass, not user input


def section_options(section: str, cls: type) -> list[OptionInfo]:
    """The options of one config dataclass."""
    out = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append(OptionInfo(f.name, section, str(f.type), default, dict(f.metadata)))
    return out
