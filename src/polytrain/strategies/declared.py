"""A strategy as the command line knows it before its module is imported: its name, its own config section
(flags, defaults and their checks: registered where it is declared), its traits and its layout.

Each of polytrain's own strategies is declared in a light module of its own (``strategies/sync_config.py``,
``parallel/pp/config.py``, ...), which imports no ``torch.distributed`` machinery and no model code: parsing
the flags, ``--help``, ``polytrain plan`` and the refusals before launch read the declared class alone. The
strategy's class (imported where a run with it is built: the launcher's checks, the workers) inherits its
declared class, so each of these is written once.
"""

from __future__ import annotations

from typing import Any, ClassVar

from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.parallel.degrees import given_degrees
from polytrain.strategies.traits import Traits

#: what ``polytrain train`` uses without ``--workers`` (a data-parallel strategy's process count)
DEFAULT_WORKERS = 2


class Declared:
    """The members of :class:`~polytrain.strategies.base.Strategy` that exist before its module is imported
    (a declared class sets them; the strategy class inherits it first)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    config_section: ClassVar[str] = ""
    traits: ClassVar[Traits] = Traits()

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        return one_process(cls, options)


def one_process(cls: Any, options: Any = None) -> Layout:
    """The layout of a strategy that runs one process, which no degree cuts (``single``, and by default)."""
    given = {axis: size for axis, size in given_degrees(options).items() if size is not None and size > 1}
    if given:
        flags = " ".join(f"--{axis.replace('_', '-')} {size}" for axis, size in given.items())
        raise ConfigError(f"--strategy {cls.name} runs one process; {flags} lays a model over several: use "
                          f"--strategy sync with it")
    return Layout.data_parallel(cls.name, 1)
