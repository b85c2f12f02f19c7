"""``--tp-plan``: which layers the ``tp`` degree (``--tp``, :mod:`polytrain.parallel.degrees`) splits; and
``tp`` as declared (:mod:`polytrain.strategies.declared`): imported by the command line without :mod:`.strategy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.options import option, register_section
from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare, mesh_layout
from polytrain.strategies.traits import Traits

READERS = ("tp", "fsdp", "pipeline", "hybrid")


@register_section("tp", "tensor parallel (strategy tp; the tp axis of pipeline and hybrid)", order=75)
@dataclass
class TensorParallelConfig:
    tp_plan: str = option("auto", "which layers --tp splits: a TOML file mapping module names to colwise or "
                                  "rowwise (blocks.*.mlp.0 = \"colwise\"), or auto: the model's own tp_plan "
                                  "(transformer_lm has one)", metavar="FILE.toml|auto", strategies=READERS)


@declare
class TensorParallelDeclared(Declared):
    name = "tp"
    summary = "tensor parallel: the plan's layers split over --tp ranks (DTensor), --workers / --tp replicas"
    config_section = "tp"
    traits = Traits(exchange="sync", meeting="gradients averaged every step", fills="tp", cuts=("tp",))

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        return mesh_layout(cls, workers, options)
