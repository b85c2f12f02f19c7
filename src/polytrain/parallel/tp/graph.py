"""The tensor-parallel plan applied to a traced pipeline stage, whose layers are graph modules.

The tracer (:mod:`polytrain.parallel.pp.traced`) turns each of the model's modules into a graph module that
calls ``aten.linear`` (or ``aten.embedding``) on its own ``weight`` and ``bias``, and the graphs around them hold
the shapes of the whole model: a view to ``(batch, time, -1, head_dim)``, a split of the fused q, k, v output
at the whole width, a reshape back to the whole width. torch's ``ColwiseParallel``/``RowwiseParallel`` take
``nn.Linear``/``nn.Embedding`` modules only; their partition and their input and output handling do not
depend on the class, so here they are applied to the graph module of each layer the plan names, and a colwise
layer keeps its output a DTensor (``use_local_output=False``): the traced graph between a colwise layer and
its rowwise partner then runs on DTensors, whose shapes are the whole model's, so its baked shapes hold.
A rowwise layer's output is whole on every tp rank (a plain tensor), as a stage's outputs must be; a plain
tensor made inside the graph that meets a DTensor there (a rotary embedding's cos and sin) counts as whole on
every rank (:func:`plain_as_replicated`, around the schedule's step and the evaluation).

What DTensor lacks for this on CPU: a sharding rule for ``aten._scaled_dot_product_flash_attention_for_cpu``
(and its backward), which ``scaled_dot_product_attention`` runs on CPU. :func:`register_cpu_attention` gives
one through torch's ``register_sharding``: the heads (dim 1 of q, k, v, the output and its log-sum-exp)
sharded alike, or everything whole (an attention mask whole in both).

A fused projection of several parts (q, k, v) is split as one colwise layer (rows ``Shard(0)``); the split of
its output into q, k and v then gathers it whole on each rank, and attention runs on every head there; the
projection after it takes its share of the heads again. Correct, but attention is not divided: a model with
separate q, k and v projections (a Hugging Face Llama) divides it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from torch import nn

from polytrain.parallel.tp.plan import TensorPlan

_REGISTERED = False


def plain_as_replicated(on: bool) -> Any:
    """While a traced stage split over tp runs (``on``), forward and backward: a plain tensor meeting a DTensor
    counts as whole on every tp rank (torch's ``implicit_replication``), as the rotary embedding's cos and sin
    (made inside the forward, not parameters) are on each rank; else nothing."""
    import contextlib

    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


def register_cpu_attention() -> None:
    """DTensor's sharding rule for CPU attention (forward and backward): heads sharded, or all replicated."""
    global _REGISTERED
    if _REGISTERED:
        return
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    aten = torch.ops.aten

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        mask = [] if attn_mask is None else [Replicate()]  # (batch, 1, time, time): the same for every head
        return [([Replicate()] * 2, [Replicate()] * 3 + [None, None] + mask),
                ([Shard(1)] * 2, [Shard(1)] * 3 + [None, None] + mask)]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def backward(grad, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None):
        mask = [] if attn_mask is None else [Replicate()]
        return [([Replicate()] * 3, [Replicate()] * 6 + [None, None] + mask),
                ([Shard(1)] * 3, [Shard(1)] * 6 + [None, None] + mask)]

    _REGISTERED = True


def split_graph(stage: nn.Module, plan: TensorPlan, mesh: Any, model: nn.Module) -> int:
    """The plan's layers of the traced ``stage`` (its modules named as ``model``'s) split over the 1-D ``mesh``;
    returns how many. Each rank cuts its part of the whole values it holds (no exchange)."""
    register_cpu_attention()
    count = 0
    own = dict(model.named_modules())
    for name, sub in list(stage.named_modules()):
        rule = next((r for r in plan.rules if name and r.matches(name)), None)
        if rule is None:
            continue
        embedding = isinstance(own.get(name), nn.Embedding)
        _style(rule.style, embedding, rule.gather).apply(sub, mesh)
        count += 1
    return count


def _style(style: str, embedding: bool, gather: bool) -> Any:
    from torch.distributed.tensor import Replicate, Shard, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Graph:
        """A torch style applied to a graph module as to the module kind it was traced from."""

        def apply(self, module: nn.Module, mesh: Any) -> None:
            distribute_module(module, mesh, self._partition,
                              partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                              partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    class Colwise(Graph, ColwiseParallel):
        def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
            self._partition_linear_fn(name, module, mesh)

    class Rowwise(Graph, RowwiseParallel):
        def _partition(self, name: str, module: nn.Module, mesh: Any) -> None:
            (self._partition_embedding_fn if embedding else self._partition_linear_fn)(name, module, mesh)

    if style == "rowwise":
        made: Any = Rowwise(input_layouts=Replicate()) if embedding else Rowwise()
        made.desired_input_layouts = (Replicate(),) if embedding else (Shard(-1),)
    else:
        made = Colwise(output_layouts=Replicate()) if gather else Colwise(use_local_output=False)
    made.src_data_rank = None  # every rank holds the same whole values: each cuts its own part
    return made
