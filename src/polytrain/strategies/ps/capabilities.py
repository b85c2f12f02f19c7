"""The capabilities of ``async``'s ranks (:mod:`polytrain.strategies.base`): a server's and a helper's own loops,
and the tickets that hand a worker slices of any step."""

from __future__ import annotations

from typing import Any

from polytrain.strategies.ps.server import ParameterServer
from polytrain.strategies.step import RunSource


class ServerLoop:
    """A parameter server's own loop (capability ``own_loop``): serve until every worker is done."""

    def __init__(self, server: ParameterServer):
        self.server = server

    def run(self, source: RunSource) -> dict[str, Any]:
        return {"role": "server", **self.server.serve()}


class HelperLoop:
    """An ``--tolerate-worker-loss`` helper's own loop: slices of any step until none is left."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def run(self, source: RunSource) -> dict[str, Any]:
        return self.strategy._help()


class Tickets:
    """Capability ``out_of_order``: a worker draws whole global batches and computes the slices its tickets
    name, of any step (a helper's, or one a lost worker held)."""

    def __init__(self, strategy: Any):
        self.strategy = strategy

    def bind(self, source: RunSource) -> None:
        self.strategy.source = source
        self.strategy._global_batch = source.global_batch  # for describe(): what one push holds
