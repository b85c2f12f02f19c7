"""Parallel strategies, chosen by name: ``single``, ``sync``, ``local-sgd``, ``diloco``, ``async``, ``pipeline``,
``hybrid`` and ``tp`` (the registry imports them when a name is first looked up, so importing one strategy's module
first never meets a half-imported other); the protocol is :mod:`polytrain.strategies.base`."""

from polytrain.builtin_strategies import DEFAULT_STRATEGY
from polytrain.strategies.base import Strategy
from polytrain.strategies.registry import available_strategies, get_strategy, register_strategy

__all__ = ["DEFAULT_STRATEGY", "Strategy", "available_strategies", "get_strategy", "register_strategy"]
