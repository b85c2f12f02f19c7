"""``single`` as declared (:mod:`polytrain.strategies.declared`): one process, no settings of its own."""

from __future__ import annotations

from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare


@declare
class SingleDeclared(Declared):
    name = "single"
    summary = "one process on one device"
