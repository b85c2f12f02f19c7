"""The ``tp`` axis of ``pipeline`` and ``hybrid``: each stage's layers split over T tensor-parallel ranks.

``--strategy hybrid --dp D --pp P --tp T`` lays out D x P x T processes on a ``dp x pp x tp`` mesh (tp
innermost, so a stage's tp ranks are neighbours), in torchtitan's order of application: the model is cut
into stages (pp), each stage's layers are split by the tensor-parallel plan (tp), and the stages' gradients
are averaged over the replicas (dp). Rank ``t`` of one stage exchanges activations with rank ``t`` of the
next (the ``pp`` group of fixed dp and tp); the activations between stages are whole on every tp rank.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from polytrain.parallel.tp.graph import split_graph
from polytrain.parallel.tp.plan import plan_for
from polytrain.parallel.dtensor import rebuild_optimizer
from polytrain.parallel.tp.strategy import check_tp, clip_grads, split_layers

__all__ = ["check_axis", "clip_grads", "split_stages"]


def check_axis(layout: Any, config: Any, model: nn.Module | None) -> None:
    """Before launch: the plan splits the model over ``--tp`` (one ConfigError line if not); what the tp axis
    does not combine with."""
    tp = layout.axis("tp")
    if tp < 2:
        return
    check_tp(config, model, tp)


def split_stages(strategy: Any) -> None:
    """This rank's stages' layers split over the tp axis of ``strategy`` (a pipeline whose stages are made);
    the split replaces their Parameter objects, so the optimizer is built again over the model's parameters,
    in ``single``'s order, with the state it held (a resumed checkpoint's) cut into this rank's parts. A traced
    stage's layers are graph modules (:mod:`.graph`); the model's names then take their split parameters."""
    from polytrain.parallel.pp import split as pipeline_split

    plan = plan_for(strategy.model, strategy.options.tp_plan)
    mesh = strategy.topology.mesh["tp"]
    if strategy.is_traced:
        before = {s: dict(strategy.modules[s].named_parameters(remove_duplicate=False)) for s in strategy.mine}
        for stage in strategy.mine:
            split_graph(strategy.modules[stage], plan, mesh, strategy.model)
        strategy._adopt_shards(before)
    else:
        parts = dict(pipeline_split.units(strategy.model))
        names = [name for stage in strategy.mine for name in strategy.split.stage_units(stage)]
        split_layers([(name, parts[name]) for name in names], plan, mesh)
    strategy.owned = [p for s in strategy.mine for p in strategy.modules[s].parameters()]
    strategy.optimizer = rebuild_optimizer(strategy.model, strategy.optimizer, strategy._make_optimizer)
