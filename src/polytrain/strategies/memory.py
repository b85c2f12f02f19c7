"""The memory plan's part of a strategy: the copies of the parameters it keeps besides the model, gradients and
optimizer state, as it declares them (``traits.copies``: diloco's ``anchor``, the parameters at the last
meeting, and its outer momentum), of this rank's shard (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

from dataclasses import replace

from polytrain.parallel.fsdp_memory import sharded
from polytrain.parallel.memory_count import Count, RankMemory, TensorSize


def copies(count: Count, row: RankMemory, tensors: list[TensorSize], shard: int, index: int) -> RankMemory:
    """``row`` with the copies of the parameters the strategy keeps (``traits.copies``): an anchor (diloco's:
    every parameter) and its outer momentum (the trained ones), of this rank's shard."""
    if "anchor" not in count.traits.copies:
        return row
    params = [t for t in tensors if t.name in count.param_names]
    outer = count.config.periodic.outer_momentum
    if shard > 1:
        anchor, momentum, _ = sharded(count, params, shard, index)
    else:
        anchor, momentum = count.params(params), count.grads(params)
    return replace(row, optimizer=row.optimizer + anchor + (momentum if (0.9 if outer is None else outer) > 0
                                                             else 0))


def notes(count: Count) -> None:
    """What the strategy's rows include besides its state, or how a strategy of one's own is estimated."""
    strategy = count.layout.strategy
    if "anchor" in count.traits.copies:
        count.notes.append(f"{strategy}'s optimizer column includes its anchor (a copy of the parameters) and "
                           "the outer momentum")
    elif not count.traits.exchange and count.layout.processes > 1:  # a strategy of one's own
        count.notes.append(f"--strategy {strategy} is estimated as a data-parallel one: each trainer holds the "
                           "whole model")
