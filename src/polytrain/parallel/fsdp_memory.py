"""The memory plan's dp_shard axis: a rank's shard of each tensor as FSDP2 cuts it (dim-0 chunks padded to equal
size, the optimizer's state over the unpadded rows), and the whole parameters it holds gathered besides: the
largest unit's during its forward and backward, every unit's with ``--no-reshard-after-forward``, a pipeline
stage's for the step (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

from dataclasses import replace

from polytrain.parallel.memory_count import Count, TensorSize, tensor_sizes


def gathered_units(count: Count, shapes: dict[str, tuple[int, ...]]) -> list[int]:
    """Each unit's parameter bytes (its tp part where tp splits it): what FSDP gathers whole for it."""
    from polytrain.parallel.pp.split import units

    out = []
    for name, unit in units(count.model):
        tensors = [replace(t, shape=shapes.get(t.name, t.shape)) for t in tensor_sizes(unit, f"{name}.")]
        out.append(count.params(tensors))
    return out or [count.params(count.tensors)]

def gathered(count: Count, tensors: list[TensorSize], units: list[int], staged: bool) -> tuple[int, str]:
    """What a sharded rank holds gathered besides its shards, and what that is."""
    if staged:  # a pipeline's stages stay gathered from a step's first forward to its last backward
        return count.params(tensors), "--dp-shard in a pipeline: the stages' whole parameters, gathered for " \
                                     "the step"
    reshard = getattr(getattr(count.config, "fsdp", None), "reshard_after_forward", True)
    if reshard:
        return max(units), "fsdp: the largest unit's whole parameters, gathered for its forward and backward"
    return sum(units), ("fsdp --no-reshard-after-forward: every unit's whole parameters, gathered from forward "
                        "to backward")

def sharded(count: Count, tensors: list[TensorSize], n: int, index: int) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes of shard ``index`` of ``n`` of ``tensors``, as FSDP2 cuts them:
    dim-0 chunks padded to equal size, the optimizer's state over the unpadded rows."""
    params = grads = state = 0
    for t in tensors:
        rows = t.shape[0] if t.shape else 1
        row = t.numel // max(rows, 1) * t.element_size if t.shape else t.element_size
        chunk = -(-rows // n)
        mine = max(0, min(chunk, rows - index * chunk))
        params += chunk * row
        if t.trained:
            grads += chunk * row
            state += count.optimizers[t.element_size].bytes(mine * row // t.element_size)
    return params, grads, state
