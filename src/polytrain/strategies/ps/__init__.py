"""Asynchronous data parallel through parameter servers: the partition of the parameters, the staleness policy,
the server, the client, and the ``async`` strategy built on them (:mod:`.strategy`, registered by :mod:`polytrain.strategies`).
"""

from polytrain.strategies.ps.book import ServerBook, UpdateRecord
from polytrain.strategies.ps.client import ParameterClient
from polytrain.strategies.ps.ranks import Ranks
from polytrain.strategies.ps.partition import PartitionPlan, Piece, TensorSpec
from polytrain.strategies.ps.server import ParameterServer
from polytrain.strategies.ps.staleness import StalenessPolicy

__all__ = ["Ranks", "ParameterClient", "ParameterServer", "PartitionPlan", "Piece", "ServerBook",
           "StalenessPolicy", "TensorSpec", "UpdateRecord"]
