"""``local-sgd``'s and ``diloco``'s settings (``--sync-every``, the outer step's ``--outer-lr`` ...) and the two
as declared (:mod:`polytrain.strategies.declared`): imported by the command line without
:mod:`polytrain.strategies.periodic`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.options import option, register_section
from polytrain.strategies.declared import Declared
from polytrain.strategies.registry import declare, mesh_layout
from polytrain.strategies.traits import Traits

#: how diloco's outer gradients travel (--outer-quantize: strategies/streaming.py)
QUANTIZE_CHOICES = ("off", "int8", "int4")

#: DiLoCo's outer settings (Douillard et al. 2023, section 3): Nesterov momentum 0.9, outer learning rate 0.7
DEFAULT_OUTER_LR = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9


def _below_one(value: float) -> None:
    if value >= 1:
        raise ValueError(f"must be below 1 (a momentum of 1 never forgets a step), got {value:g}")


def _fraction(value: float) -> None:
    if not 0 <= value <= 1:
        raise ValueError(f"must be between 0 and 1, got {value:g}")


def _positive(value: float) -> None:
    if value <= 0:
        raise ValueError(f"must be > 0, got {value:g}")


#: what --strategy local-sgd is told of diloco's outer settings (strategies/settings.py)
_OUTER = ("{flags} {verb} the outer step of --strategy diloco; --strategy {strategy} averages the parameters "
          "(drop them, or use diloco)")


@register_section("periodic", "strategies local-sgd and diloco", order=72)
@dataclass
class PeriodicConfig:
    sync_every: int = option(8, "local-sgd, diloco: every worker steps its own optimizer, and the workers' "
                                "parameters meet every H steps (averaged, or diloco's outer step)",
                             minimum=1, metavar="H")
    outer_lr: float | None = option(None, f"diloco: outer SGD learning rate on the averaged parameter change "
                                          f"(default {DEFAULT_OUTER_LR:g}; 1 with momentum 0 is local-sgd)",
                                    check=_positive, metavar="L", strategies=("diloco",), elsewhere=_OUTER)
    outer_momentum: float | None = option(None, f"diloco: outer Nesterov momentum (default: 1 - outer lr, "
                                                f"{1 - DEFAULT_OUTER_LR:g}, when the inner optimizer has momentum "
                                                f"(sgd, rmsprop with --momentum > 0), else the paper's "
                                                f"{DEFAULT_OUTER_MOMENTUM:g}; 0: plain outer SGD)",
                                          minimum=0, check=_below_one, metavar="M", strategies=("diloco",),
                                          elsewhere=_OUTER)
    fragments: int = option(1, "diloco: streaming DiLoCo: the parameters cut into F fragments of about equal size, "
                               "each meeting every H steps, fragment p at steps p*H/F + kH (1: all at once)",
                            minimum=1, metavar="F", strategies=("diloco",), elsewhere=_OUTER)
    overlap_steps: int = option(0, "diloco: a meeting's exchange runs during the next T inner steps and is "
                                   "applied after them (streaming DiLoCo's overlap; 0: wait for it)",
                                minimum=0, metavar="T", strategies=("diloco",), elsewhere=_OUTER)
    overlap_mix: float = option(0.5, "diloco: with --overlap-steps, a fragment becomes MIX x its local "
                                     "parameters + (1 - MIX) x the outer step's (streaming DiLoCo's alpha)",
                                check=_fraction, metavar="MIX", strategies=("diloco",), elsewhere=_OUTER)
    outer_quantize: str = option("off", "diloco: send each worker's outer gradient as int8 or int4 (a float32 "
                                        "scale per 256 values, by all-gather), or off (parameters all-reduced "
                                        "in their own dtype)", choices=QUANTIZE_CHOICES, strategies=("diloco",),
                                 elsewhere=_OUTER)
    outer_error_feedback: bool = option(False, "diloco: with --outer-quantize, each worker adds what rounding "
                                               "left out of its last outer gradient to the next",
                                        strategies=("diloco",), elsewhere=_OUTER)


@declare
class LocalSGDDeclared(Declared):
    name = "local-sgd"
    summary = "local SGD: each worker its own optimizer on its slice, parameters averaged every --sync-every H steps"
    config_section = "periodic"
    # a replica may be fsdp-sharded: the replicas then meet on each rank's shard; --on-failure continue: every
    # rank a whole replica (and diloco's)
    traits = Traits(exchange="local-sgd", meeting="parameters averaged every --sync-every H steps",
                    cuts=("dp_shard",), lost_worker=None)

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        opts = options if options is not None else PeriodicConfig()
        return mesh_layout(cls, workers, options, meets_every=opts.sync_every)


@declare
class DilocoDeclared(LocalSGDDeclared):
    name = "diloco"
    traits = replace(LocalSGDDeclared.traits, exchange="diloco", copies=("anchor",),
                     meeting="an outer Nesterov SGD step on the averaged change every --sync-every H steps")
    summary = ("DiLoCo: each worker its own (inner) optimizer on its slice; every --sync-every H steps an outer "
               "Nesterov SGD step on the averaged parameter change")
