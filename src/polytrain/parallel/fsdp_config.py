"""``fsdp``'s settings (``--reshard-after-forward``) and ``fsdp`` as declared
(:mod:`polytrain.strategies.declared`): imported by the command line without :mod:`polytrain.parallel.fsdp`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.options import option, register_section
from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare, mesh_layout
from polytrain.strategies.traits import Traits


@register_section("fsdp", "strategy fsdp (sharded data parallel)", order=73)
@dataclass
class FsdpConfig:
    reshard_after_forward: bool = option(True, "fsdp: free each unit's gathered parameters after its forward and "
                                               "gather them again for its backward (ZeRO-3); off keeps them "
                                               "until backward (ZeRO-2-like: one all-gather less a step, more "
                                               "memory)")


@declare
class FsdpDeclared(Declared):
    name = "fsdp"
    summary = "sharded data parallel (FSDP2): each worker a slice of every batch and 1/N of the model's state"
    config_section = "fsdp"
    # bf16-mixed: FSDP2's MixedPrecisionPolicy (see _policy); --tp: each unit's plan layers split over tp first,
    # then sharded (FSDP x TP, 2-D), reading --tp-plan
    traits = Traits(exchange="sync", meeting="gradients averaged every step", fills="dp_shard",
                    cuts=("dp_shard", "tp"), own_precision=("bf16-mixed",), reads=("tp",),
                    lost_worker="keeps each parameter and optimizer shard on one worker only without "
                                "--dp-replicate, so a dead worker's shards are gone",
                    replicas_heal=True)

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        return mesh_layout(cls, workers, options)
