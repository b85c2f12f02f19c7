"""A model's units: its top-level children, a ``ModuleList`` counted as its items (``transformer_lm`` gives
``embed, blocks.0 ... blocks.N-1, head``; an ``nn.Sequential`` gives ``0, 1, ...``). A pipeline cuts between
units, FSDP shards each, activation checkpointing and ``--compile`` wrap each, and a model built on the meta
device is materialised unit by unit (:mod:`polytrain.models.deferred`)."""

from __future__ import annotations

from torch import nn


def units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units in forward order, with their names in the whole model."""
    found = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            found += [(f"{name}.{index}", item) for index, item in child.named_children()]
        else:
            found.append((name, child))
    return found
