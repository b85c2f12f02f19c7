"""``pipeline``'s and ``hybrid``'s settings (``--microbatches``, ``--schedule``, ``--split-at``, ...) and the two
as declared (:mod:`polytrain.strategies.declared`): imported by the command line without :mod:`.strategy`
(pipelining, the tracer)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.options import option, register_section
from polytrain.parallel.pp.plan import SCHEDULES
from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare, mesh_layout
from polytrain.strategies.traits import Traits


#: what --strategy pipeline is told of hybrid's deprecated mesh settings (strategies/settings.py)
_MESH = ("{given}: hybrid's deprecated name of --dp-replicate, which --strategy {strategy} does not read; use "
         "--dp-replicate (or --strategy hybrid)")


#: the pipeline's stages where neither --pp nor --stages says
DEFAULT_STAGES = 2


@register_section("pipeline", "strategies pipeline and hybrid", order=74)
@dataclass
class PipelineConfig:
    stages: int | None = option(None, "pipeline, hybrid: deprecated, the same as --pp P (one flag per degree)",
                                minimum=2, metavar="P")
    microbatches: int = option(4, "pipeline, hybrid: micro-batches per replica's batch (must divide it)",
                               minimum=1, metavar="M")
    schedule: str = option("1f1b", "pipeline, hybrid: the torch.distributed.pipelining schedule "
                                   "(polytrain plan prints it)", choices=tuple(SCHEDULES))
    split_at: str = option("auto", "pipeline, hybrid: units that start stages 1.. (blocks.2,blocks.4), or "
                                   "auto (balanced by each unit's measured forward+backward time)",
                           metavar="UNITS|auto")
    dp: int | None = option(None, "hybrid: deprecated, the same as --dp-replicate D (--dp-shard D with "
                                  "--shard-dp)", minimum=1, strategies=("hybrid",), elsewhere=_MESH)
    shard_dp: bool = option(False, "hybrid: deprecated: --dp-shard D shards each stage's parameters, gradients "
                                   "and optimizer state over D ranks (what --dp D --shard-dp did)",
                            strategies=("hybrid",))


@declare
class PipelineDeclared(Declared):
    name = "pipeline"
    summary = "pipeline parallel: layers split into --stages processes, micro-batched (gpipe, 1f1b, ...)"
    config_section = "pipeline"
    # a model from any factory comes on the meta device (models/replay.py: _replay); --tp-plan: the plan of the
    # tp axis of T ranks per stage (polytrain.parallel.tp.axis); --workers is not read: the processes are the
    # stages (times the other degrees)
    traits = Traits(exchange="sync", meeting="gradients averaged every step", fills=None,
                    cuts=("dp_shard", "pp", "tp"), degrees={"pp": DEFAULT_STAGES}, builds_part=True, reads=("tp",))

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        return mesh_layout(cls, workers, options)


@declare
class HybridDeclared(PipelineDeclared):
    name = "hybrid"
    summary = "data parallel x pipeline: --dp-replicate D replicas of a --pp P stage pipeline on a 2-D mesh"
    traits = replace(PipelineDeclared.traits, fills="dp_replicate")  # what --workers leaves besides the stages
