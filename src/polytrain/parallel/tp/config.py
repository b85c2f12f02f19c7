"""``--tp`` and ``--tp-plan``: the settings of ``--strategy tp`` and of the ``tp`` axis of ``pipeline``/``hybrid``."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.options import option, register_section

READERS = ("tp", "pipeline", "hybrid")


@register_section("tp", "tensor parallel (strategy tp; the tp axis of pipeline and hybrid)", order=75)
@dataclass
class TensorParallelConfig:
    tp: int | None = option(None, "tensor-parallel ranks each layer of the plan is split over (Megatron-style, "
                                  "DTensor); --strategy tp: all of --workers by default, else --workers / --tp "
                                  "data-parallel replicas; pipeline, hybrid: T ranks per stage (default 1)",
                            minimum=1, metavar="T", strategies=READERS)
    tp_plan: str = option("auto", "which layers --tp splits: a TOML file mapping module names to colwise or "
                                  "rowwise (blocks.*.mlp.0 = \"colwise\"), or auto: the model's own tp_plan "
                                  "(transformer_lm has one)", metavar="FILE.toml|auto", strategies=READERS)
