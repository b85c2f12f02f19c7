"""Parallel strategies, chosen by name: ``single``, ``sync``, ``local-sgd``, ``diloco``, ``async``, ``pipeline``,
``hybrid`` and ``tp`` (importing this package registers them); the protocol is :mod:`polytrain.strategies.base`."""

from polytrain.strategies import single, sync  # noqa: F401  (registers them)
from polytrain.strategies import periodic  # noqa: F401  (local-sgd, diloco)
from polytrain.parallel import pp  # noqa: F401  (pipeline, hybrid)
from polytrain.parallel import fsdp  # noqa: F401  (fsdp)
from polytrain.parallel import tp  # noqa: F401  (tp)
from polytrain.strategies.ps import strategy as _ps  # noqa: F401  (async)
from polytrain.strategies.base import Strategy
from polytrain.strategies.registry import available_strategies, get_strategy, register_strategy

#: what ``polytrain train`` uses without --strategy
DEFAULT_STRATEGY = "sync"

__all__ = ["DEFAULT_STRATEGY", "Strategy", "available_strategies", "get_strategy", "register_strategy"]
