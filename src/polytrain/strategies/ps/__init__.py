"""Asynchronous data parallel through parameter servers: the partition of the parameters, the staleness policy,
the server, the client, and the ``async`` strategy built on them (:mod:`.strategy`; its settings, light, in
:mod:`.config`). The names below are imported on first use (PEP 562): the command line imports :mod:`.config`
alone."""

import importlib as _importlib

_EXPORTS = {
    "ServerBook": "book", "UpdateRecord": "book", "ParameterClient": "client", "Ranks": "ranks",
    "PartitionPlan": "partition", "Piece": "partition", "TensorSpec": "partition", "ParameterServer": "server",
    "StalenessPolicy": "staleness",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polytrain.strategies.ps' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"polytrain.strategies.ps.{_EXPORTS[name]}"), name)
    globals()[name] = value  # once
    return value
