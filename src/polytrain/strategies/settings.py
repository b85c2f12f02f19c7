"""Which strategy reads which setting, and the one check that refuses a setting the chosen strategy ignores.

A strategy reads its own config section (``Strategy.config_section``) and nothing of another's; a field of
a section shared by several strategies (``periodic``: local-sgd and diloco; ``pipeline``: pipeline and
hybrid) may say which of them read it (``option(..., strategies=...)``). A setting changed from its default
that the chosen strategy does not read would be silently dropped: :func:`check_settings_read` makes it one
line before anything starts (``--servers 2`` with ``--strategy sync``, ``--outer-lr`` with ``local-sgd``,
``--dp`` with ``pipeline``).
"""

from __future__ import annotations

from typing import Any

from polytrain.errors import ConfigError
from polytrain.options import section_defaults, section_options


def readers(strategies: dict[str, Any]) -> dict[str, list[str]]:
    """Each strategy section and the strategies (names, sorted) that read it, from ``{name: class}``."""
    owners: dict[str, list[str]] = {}
    for name, cls in sorted(strategies.items()):
        if cls.config_section:
            owners.setdefault(cls.config_section, []).append(name)
    return owners


def unread_settings(config: Any, strategy: Any, strategies: dict[str, Any]) -> list[tuple[str, Any, list[str], str]]:
    """Settings changed from their default that ``strategy`` does not read: (key, value, the strategies that
    read it, the template to tell a strategy of the same section, or "")."""
    out = []
    for section, owners in readers(strategies).items():
        values, defaults = getattr(config, section), section_defaults(section)
        for info in section_options(section, type(values)):
            value = getattr(values, info.key)
            if value == getattr(defaults, info.key):
                continue
            read_by = list(info.meta.get("strategies") or owners)
            if strategy.name in read_by or (section == strategy.config_section and not info.meta.get("strategies")):
                continue
            same_section = section == strategy.config_section
            out.append((info.key, value, read_by, info.meta.get("elsewhere") or "" if same_section else ""))
    return out


def check_settings_read(config: Any, strategy: Any, strategies: dict[str, Any]) -> None:
    """One error line when a setting the chosen ``strategy`` does not read was changed from its default."""
    unread = unread_settings(config, strategy, strategies)
    if not unread:
        return
    templates = {template for *_, template in unread}
    if len(templates) == 1 and "" not in templates:  # fields of its own section that it does not read
        many = len(unread) > 1
        raise ConfigError(templates.pop().format(
            flags=" and ".join("--" + key.replace("_", "-") for key, *_ in unread),
            given=" and ".join(_flag(key, value) for key, value, *_ in unread),
            verb="set" if many else "sets", them="them" if many else "it", strategy=strategy.name))
    if len(unread) == 1:
        (key, value, owners, _), = unread
        raise ConfigError(f"{_flag(key, value)} is a setting of --strategy {' and '.join(owners)}, which "
                          f"--strategy {strategy.name} does not read; drop it, or use {' or '.join(owners)}")
    given = ", ".join(f"{_flag(key, value)} ({', '.join(owners)})" for key, value, owners, _ in unread)
    raise ConfigError(f"{given}: settings of other strategies, which --strategy {strategy.name} does not read; "
                      "drop them")


def _flag(key: str, value: Any) -> str:
    flag = "--" + key.replace("_", "-")
    return flag if value is True else f"--no-{flag[2:]}" if value is False else f"{flag} {value}"



class Sections:
    """A strategy's options when it reads more than its own section: its own (``config_section``) and the
    sections named in its ``traits.reads`` (``pipeline`` and ``hybrid``: ``tp``, the settings
    of their tp axis), read as one: an attribute is looked up in the own section first."""

    def __init__(self, own: Any, *more: Any):
        self._parts = (own, *more)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        for part in self._parts:
            if hasattr(part, key):
                return getattr(part, key)
        raise AttributeError(key)

    def __repr__(self) -> str:
        return f"Sections{self._parts!r}"


def options_of(config: Any, strategy_cls: Any) -> Any:
    """The options a strategy of class ``strategy_cls`` reads: its own config section (None if it has none),
    with the sections it also reads (``traits.reads``) and the degrees of the mesh (``--dp-replicate`` ...
    ``--tp``: :mod:`polytrain.parallel.degrees`)."""
    own = getattr(config, strategy_cls.config_section, None) if strategy_cls.config_section else None
    more = [getattr(config, name) for name in (*strategy_cls.traits.reads, "parallel")]
    return Sections(own, *more) if own is not None else Sections(*more)
