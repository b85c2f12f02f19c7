"""The resolved configuration of a run: every component's dataclass section, merged in one place.

Precedence: built-in defaults < ``--config FILE.toml`` < command-line flags. A config file uses the
flags' names as flat keys (``batch_size = 64`` or ``batch-size = 64``); tables only for the ``*_args``
keys (``model_args = { hidden = [64, 32] }``). Unknown keys and bad values are errors that name the key
and what it accepts. ``to_toml`` writes a file that ``--config`` reads back to the same run.

The sections are those registered (:func:`polytrain.options.register_section`) by the components imported so
far; :mod:`polytrain.components` imports them all, and the command line, the Python API and the workers
import it. This module imports no component.
"""

from __future__ import annotations

import difflib
import json
import sys
from typing import Any, Iterable

from polytrain.errors import ConfigError
from polytrain.options import OptionInfo, convert, registered_sections, section_options

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class RunConfig:
    """Every setting of a training run, one attribute per registered section (``config.train.steps``,
    ``config.sync.comm``, ...), each the section's dataclass."""

    def __init__(self, **sections: Any):
        for section in registered_sections():
            setattr(self, section.name, sections.pop(section.name, None) or section.cls())
        if sections:
            raise TypeError(f"unknown config sections: {', '.join(sections)}")

    def __getattr__(self, name: str) -> Any:
        # a section registered after this config was made (a strategy module imported later, or only in a
        # worker) has its defaults
        section = None if name.startswith("__") else {s.name: s for s in registered_sections()}.get(name)
        if section is None:
            raise AttributeError(f"RunConfig has no section '{name}'")
        value = section.cls()
        setattr(self, name, value)
        return value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunConfig) and vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"RunConfig({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"

    def flat(self) -> dict[str, Any]:
        """``{key: value}`` over all sections (keys are unique across sections)."""
        return {info.key: getattr(getattr(self, info.section), info.key) for info in all_options()}

    def global_batch(self, workers: int) -> int:
        data = self.data
        return data.worker_batch_size * workers if data.worker_batch_size else int(data.batch_size)


#: pairs of settings of which a run uses one; the higher-precedence source wins, the same source may not set both
EXCLUSIVE = (("steps", "epochs"), ("batch_size", "worker_batch_size"), ("place", "placement"))


def all_options() -> list[OptionInfo]:
    out: list[OptionInfo] = []
    for section in registered_sections():
        out += section_options(section.name, section.cls)
    return out


def section_titles() -> dict[str, str]:
    return {section.name: section.title for section in registered_sections()}


class _Keys(dict):
    """Every option by its key, over the sections registered so far (read again when more are registered)."""

    def refresh(self) -> "_Keys":
        options = all_options()
        if len(options) != len(self):
            self.clear()
            self.update((info.key, info) for info in options)
            assert len(self) == len(options), "config keys must be unique across sections"
        return self


_KEYS = _Keys()


def _by_key() -> dict[str, OptionInfo]:
    return _KEYS.refresh()


def _normalise_key(key: str) -> str:
    return key.replace("-", "_")


def _unknown_key(key: str, source: str) -> ConfigError:
    close = difflib.get_close_matches(key, _by_key(), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f"; accepted keys: {', '.join(sorted(_by_key()))}"
    return ConfigError(f"{source}: unknown key '{key}'{hint}")


def read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"--config: file '{path}' does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    for key, value in raw.items():
        name = _normalise_key(key)
        if name not in _by_key():
            raise _unknown_key(key, f"config file {path}")
        values[name] = value
    return values


def resolve(file_values: dict[str, Any] | None = None, flag_values: dict[str, Any] | None = None,
            *, file_name: str = "config file") -> RunConfig:
    """Merge defaults < file < flags into a checked :class:`RunConfig`."""
    layers = [(file_values or {}, lambda k: f"{k} in {file_name}"), (flag_values or {}, lambda k: _by_key()[k].flag)]
    chosen: dict[str, Any] = {}
    for values, source_of in layers:
        typed = _converted(values, source_of)  # a bad value (--epochs 0) is named before any clash of a pair
        for group in EXCLUSIVE:
            present = [k for k in group if typed.get(k) is not None]
            if len(present) > 1:
                raise ConfigError(f"{' and '.join(source_of(k) for k in present)}: give only one of them")
            if present:  # this layer picks one of the pair: forget what a lower layer said about the other
                for other in group:
                    chosen.pop(other, None)
        chosen.update(typed)
    config = RunConfig()
    for key, value in chosen.items():
        setattr(getattr(config, _by_key()[key].section), key, value)
    for group in EXCLUSIVE:  # a default of one member yields to a chosen other member
        picked = [k for k in group if k in chosen and getattr(getattr(config, _by_key()[k].section), k) is not None]
        for other in group:
            if picked and other not in picked:
                setattr(getattr(config, _by_key()[other].section), other, None)
    return config


def _converted(values: dict[str, Any], source_of: Any) -> dict[str, Any]:
    out = {}
    for key, value in values.items():
        if key not in _by_key():
            raise _unknown_key(key, "settings")
        out[key] = convert(_by_key()[key], value, source_of(key))
    return out


def make_config(**settings: Any) -> RunConfig:
    """A config from Python keyword arguments named like the flags: ``make_config(model="mlp", steps=50)``."""
    return resolve(None, {_normalise_key(k): v for k, v in settings.items()}, file_name="arguments")


def to_toml(config: RunConfig, *, comment: str = "") -> str:
    """The resolved config as a flat TOML file that ``--config`` reads back."""
    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    by_section: dict[str, list[OptionInfo]] = {}
    for info in all_options():
        by_section.setdefault(info.section, []).append(info)
    for section, infos in by_section.items():
        lines.append(f"\n# -- {section_titles()[section]}")
        for info in infos:
            value = getattr(getattr(config, section), info.key)
            lines.append(f"{info.key} = {_toml_value(value)}" if value is not None else f"# {info.key} = (unset)")
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def options_by_section() -> Iterable[tuple[str, list[OptionInfo]]]:
    seen: dict[str, list[OptionInfo]] = {}
    for info in all_options():
        seen.setdefault(info.section, []).append(info)
    return seen.items()
