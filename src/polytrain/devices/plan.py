"""A placement plan: which sub-modules go on which device, as plain data.

A plan is an ordered list of ``pattern = device`` entries. A pattern is a module name as
``model.named_modules()`` spells it (``features``, ``classifier.2``) or a glob over those names
(``layers.*``, ``*``; ``*`` also crosses dots). The rules, in full:

1. An entry matching a module places that module *and everything inside it*.
2. When several entries apply to a module (directly or through an ancestor), the **last** one wins, like
   nested ``with tf.device(...)`` scopes: put broad patterns first, exceptions after
   (``*=cuda:0,classifier=cuda:1``).
3. Modules no entry applies to stay where they are.
4. A pattern that matches no module is an error, so a typo cannot pass silently.

Plans come from ``--place features=cuda:0,classifier=cuda:1``, from a TOML file (``--placement``) or from
a dict; devices are checked when the plan is built, patterns when it is applied to a model.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Mapping, Sequence, Union

import torch

from polytrain.devices.spec import parse_device
from polytrain.errors import DeviceError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: A device as a plan holds it: text (``"cuda:1"``) or a ``torch.device`` given from Python.
DeviceValue = Union[str, torch.device]
_EXAMPLE = "features=cuda:0,classifier=cuda:1"


@dataclass(frozen=True)
class PlacementPlan:
    """Ordered ``(pattern, device)`` entries; later entries win. ``source`` names its origin in errors."""

    entries: tuple[tuple[str, DeviceValue], ...]
    source: str = "placement"

    def __post_init__(self) -> None:
        for pattern, value in self.entries:
            _check_pattern(pattern, self.source)
            _check_device(pattern, value, self.source)

    def __str__(self) -> str:
        return ",".join(f"{pattern or '(root)'}={value}" for pattern, value in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @classmethod
    def from_flag(cls, text: str, *, source: str = "--place") -> PlacementPlan:
        """Parse ``features=cuda:0,classifier=cuda:1`` (one device per module)."""
        entries = []
        for item in text.split(","):
            pattern, eq, value = (part.strip() for part in item.partition("="))
            if eq and not pattern:
                raise DeviceError(f"{source}: '{item.strip()}' has no module name; use '*' for the whole model")
            if not eq:
                # 'features=cuda:0,1' splits into 'features=cuda:0' and '1'
                hint = " (a module goes on one device)" if pattern[:1].isdigit() else ""
                raise DeviceError(f"{source}: '{pattern}' is not MODULE=DEVICE{hint}; write e.g. {_EXAMPLE}")
            entries.append((pattern, value))
        return cls(tuple(entries), source)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> PlacementPlan:
        """Read ``module = "device"`` pairs from a TOML file, at top level or under ``[placement]``.

        Nested tables stand for dotted names, so ``[features]`` + ``0 = "cuda:0"`` is ``features.0``.
        """
        source = str(path)
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise DeviceError(f"placement file '{source}' does not exist") from None
        except OSError as exc:
            raise DeviceError(f"cannot read placement file '{source}': {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise DeviceError(f"placement file '{source}' is not valid TOML: {exc}") from None
        if set(data) == {"placement"} and isinstance(data["placement"], dict):
            data = data["placement"]
        return cls(tuple(_flatten(data, "", source)), source)

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, DeviceValue], *, source: str = "placement") -> PlacementPlan:
        """``{"features": "cuda:0", "classifier": torch.device("cuda", 1)}``, in the mapping's order."""
        return cls(tuple(mapping.items()), source)

    @classmethod
    def from_options(cls, place: str | None = None, placement: str | None = None) -> PlacementPlan | None:
        """The plan of ``--placement FILE`` then ``--place ...`` (flag entries come last, so they win)."""
        entries: list[tuple[str, DeviceValue]] = []
        sources = []
        if placement:
            entries += cls.from_toml(placement).entries
            sources.append(str(placement))
        if place:
            entries += cls.from_flag(place).entries
            sources.append("--place")
        return cls(tuple(entries), " + ".join(sources)) if entries else None

    @classmethod
    def coerce(cls, plan: PlacementPlan | Mapping[str, DeviceValue] | str) -> PlacementPlan:
        """Accept a plan, a mapping, or flag text."""
        if isinstance(plan, PlacementPlan):
            return plan
        if isinstance(plan, str):
            return cls.from_flag(plan, source="placement")
        if isinstance(plan, Mapping):
            return cls.from_mapping(plan)
        raise TypeError(f"a placement plan is a dict, a PlacementPlan or 'module=device,...' text, "
                        f"not {type(plan).__name__}")

    def devices(self) -> list[DeviceValue]:
        """The distinct devices of the plan, in first-use order."""
        seen: list[DeviceValue] = []
        for _, value in self.entries:
            if value not in seen:
                seen.append(value)
        return seen

    def assign(self, names: Sequence[str]) -> dict[str, DeviceValue]:
        """Map each module name the plan applies to onto its device (rules 1-4 of the module docstring).

        ``names`` are ``named_modules()`` names, the root being ``""``.
        """
        used = [False] * len(self.entries)
        result: dict[str, DeviceValue] = {}
        for name in names:
            chain = _self_and_ancestors(name)
            winner = None
            for i, (pattern, _) in enumerate(self.entries):
                if fnmatchcase(name, pattern):
                    used[i] = True
                    winner = i
                elif any(fnmatchcase(outer, pattern) for outer in chain[1:]):
                    winner = i
            if winner is not None:
                result[name] = self.entries[winner][1]
        for i, (pattern, _) in enumerate(self.entries):
            if not used[i]:
                raise DeviceError(f"{self.source}: '{pattern}' matches no module of the model; "
                                  f"module names: {_examples(names)}; use '*' for the whole model")
        return result


def _self_and_ancestors(name: str) -> list[str]:
    """``'a.b.c'`` -> ``['a.b.c', 'a.b', 'a', '']``."""
    if not name:
        return [""]
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)] + [""]


def _examples(names: Sequence[str], limit: int = 12) -> str:
    """Shallow names first: they are the ones a user most likely meant."""
    ordered = sorted((n for n in names if n), key=lambda n: n.count("."))
    shown = ", ".join(ordered[:limit])
    return (shown + f", ... ({len(ordered) - limit} more)") if len(ordered) > limit else (shown or "(none)")


def _flatten(data: Mapping[str, Any], prefix: str, source: str) -> list[tuple[str, DeviceValue]]:
    entries: list[tuple[str, DeviceValue]] = []
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            entries += _flatten(value, name, source)
        elif isinstance(value, str):
            entries.append((name, value))
        else:
            raise DeviceError(f"{source}: '{name}' must be a device name in quotes such as \"cuda:1\", "
                              f"got {value!r}")
    return entries


def _check_pattern(pattern: Any, source: str) -> None:
    if not isinstance(pattern, str):
        raise DeviceError(f"{source}: module name {pattern!r} must be text")
    if any(c.isspace() for c in pattern) or "=" in pattern:
        raise DeviceError(f"{source}: '{pattern}' is not a module name or pattern (e.g. features, layers.*)")


def _check_device(pattern: str, value: Any, source: str) -> None:
    if isinstance(value, torch.device):
        return
    spec = parse_device(value)
    if spec.count is not None:
        raise DeviceError(f"{source}: '{pattern}={value}' is a CPU worker count; a module goes on one device, "
                          f"e.g. '{pattern}=cpu'")
    if not spec.is_single_device:
        raise DeviceError(f"{source}: '{pattern}={value}' names several devices; a module goes on one device "
                          f"(give each module its own entry, e.g. {_EXAMPLE})")
