"""``single``: one process, one device; the reference every other strategy must match."""

from __future__ import annotations

from polytrain.strategies.base import Strategy, register_strategy


@register_strategy
class SingleDevice(Strategy):
    name = "single"
    summary = "one process on one device"
