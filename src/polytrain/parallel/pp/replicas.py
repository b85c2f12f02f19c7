"""A pipeline's replicas (``hybrid``, the ``dp`` degrees of ``pipeline``): each stage's shard over ``dp_shard``
(``fully_shard``, HSDP with ``dp_replicate``), the gradients of whole stages averaged over the replicas, and
``--clip-grad-norm`` over every stage, replica and tp rank. A mixin of
:class:`~polytrain.parallel.pp.strategy.Pipeline`, which sets the attributes read here."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from polytrain.parallel.dtensor import average, local, rebuild_optimizer, squared_norm
from polytrain.parallel.fsdp import shard_group
from polytrain.models.parts import unit_groups
from polytrain.parallel.tp import axis as tp_axis


class StageReplicas:
    """What the ranks of one stage in different replicas do together."""

    def _shard(self) -> None:
        """``--shard-dp``, at first use (after rank 0 has run the units whole to check the forward): each unit
        of this rank's stages, then the stage, ``fully_shard``-ed over the dp axis. The parameters are kept
        gathered from a step's first forward to its last backward (no gather per micro-batch); the stage's
        gradient reduce-scatter waits for the last micro-batch (torch's ``PipelineStage`` turns the sync off
        until then) and reshards. fully_shard replaces the Parameter objects, so the optimizer is built
        again over the model's parameters, in ``single``'s order, and given the state it held (a resumed
        checkpoint's), cut into this rank's shards."""
        from torch.distributed.fsdp import fully_shard

        assert self.optimizer is not None
        mesh = self.topology.submesh("dp_replicate", "dp_shard")  # HSDP where there are replicas too
        before = {s: dict(self.modules[s].named_parameters(remove_duplicate=False)) for s in self.mine}
        for stage in self.mine:
            module = self.modules[stage]
            parts, ignored = self._stage_parts(stage) if self.is_traced else \
                (list(zip(self.split.stage_units(stage), module)), set())
            for group in unit_groups(parts):  # units sharing a tensor (tied weights): one shard group
                shard_group([unit for _, unit in group], mesh, reshard_after_forward=False)
            fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=ignored or None)
        if self.is_traced:  # the traced stages' modules are not the model's: its names take their shards
            self._adopt_shards(before)
        self.owned = [p for s in self.mine for p in self.modules[s].parameters()]
        self._stage_bytes = sum(p.numel() * p.element_size() for p in self.owned)
        self.optimizer = rebuild_optimizer(self.model, self.optimizer, self._make_optimizer)

    def _average_over_replicas(self) -> None:
        grads = [local(p.grad) for p in self.owned if p.grad is not None]  # (tp: each rank's part)
        self.traffic.all_reduce(average(grads, self.topology.axis_group("dp"), self.replicas), self.replicas)

    def _clip(self, max_norm: float) -> None:
        """clip_grad_norm_ over all stages: the squared norms of each rank's gradients summed over pp (and over
        dp, sharded: each replica holds 1/D of its stages' gradients)."""
        more = (self.topology.axis_group("pp"),) if self.ranks > 1 else ()
        if self.tp > 1 and self.sharded:  # over two meshes: each gradient's pieces summed over the axes it is cut
            squared = squared_norm([p.grad for p in self.owned if p.grad is not None], self.topology.device)
            for group in more:
                dist.all_reduce(squared, group=group)
            coef = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
            for p in self.owned:
                if p.grad is not None:
                    local(p.grad).mul_(coef)
            return None
        if self.tp > 1:  # the split layers' squared norms summed over tp, the whole ones counted once
            return tp_axis.clip_grads(self.owned, max_norm, self.topology.axis_group("tp"), more)
        skip = self._counted_once()  # a tied tensor's gradient counted on one of its ranks
        grads = [local(p.grad) for p in self.owned if p.grad is not None and id(p) not in skip]
        norms = [torch.linalg.vector_norm(g, 2) for g in grads]
        squared = (torch.stack(norms) ** 2).sum() if norms else torch.zeros((), device=self.topology.device)
        if self.sharded:
            dist.all_reduce(squared, group=self.topology.axis_group("dp_shard"))
        if self.ranks > 1:
            dist.all_reduce(squared, group=self.topology.axis_group("pp"))
        coef = torch.clamp(max_norm / (squared.sqrt() + 1e-6), max=1.0)
        for p in self.owned:
            if p.grad is not None:
                local(p.grad).mul_(coef)


def reshard(module: nn.Module) -> None:
    """Back to this rank's shards after a forward that gathered them (an evaluation)."""
    from torch.distributed.fsdp import FSDPModule

    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()
