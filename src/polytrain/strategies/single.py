"""``single``: one process, one device; the reference every other strategy must match."""

from __future__ import annotations

from typing import Any

from polytrain.strategies.base import Strategy
from polytrain.strategies.registry import register_strategy
from polytrain.strategies.held import HeldState
from polytrain.strategies.single_config import SingleDeclared


@register_strategy
class SingleDevice(SingleDeclared, Strategy):

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.held_state = HeldState(self)  # the whole model: a resume reads the checkpoint straight into it
