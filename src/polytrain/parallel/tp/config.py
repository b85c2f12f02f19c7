"""``--tp-plan``: which layers the ``tp`` degree (``--tp``, :mod:`polytrain.parallel.degrees`) splits."""

from __future__ import annotations

from dataclasses import dataclass

from polytrain.options import option, register_section

READERS = ("tp", "fsdp", "pipeline", "hybrid")


@register_section("tp", "tensor parallel (strategy tp; the tp axis of pipeline and hybrid)", order=75)
@dataclass
class TensorParallelConfig:
    tp_plan: str = option("auto", "which layers --tp splits: a TOML file mapping module names to colwise or "
                                  "rowwise (blocks.*.mlp.0 = \"colwise\"), or auto: the model's own tp_plan "
                                  "(transformer_lm has one)", metavar="FILE.toml|auto", strategies=READERS)
