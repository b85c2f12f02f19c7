"""What a strategy is, declared once as data (:class:`Traits`): how its replicas meet, which degrees it takes
and fills, what it does itself. The checks before launch, the registry and the trainer read these fields; none
of them asks a strategy anything else by name or probes it with ``getattr``."""

from __future__ import annotations

from dataclasses import dataclass, field

#: why the survivors of a lost worker cannot go on without it, for a strategy that does not keep whole replicas
NOT_WHOLE = "does not keep a whole replica of the model and optimizer on every rank"


@dataclass(frozen=True)
class Traits:
    """A strategy class's declared traits (``traits = Traits(...)``)."""

    #: how the replicas meet: ``sync`` (gradients averaged every step), ``local-sgd``, ``diloco``, ``async``;
    #: "" for none. Registered classes of one exchange run each other's degrees (``sync --dp-shard 4``: fsdp)
    exchange: str = ""
    #: what the replicas exchange, in words (``polytrain plan``)
    meeting: str = "nothing (one process)"
    #: the degree ``--workers`` fills (None: the processes are the product of the degrees, ``pipeline``)
    fills: str | None = "dp_replicate"
    #: the axes over which this class cuts one replica (dp_shard, pp, tp), besides the replicas themselves
    cuts: tuple[str, ...] = ()
    #: degrees where the settings name none (``pipeline``: 2 stages)
    degrees: dict[str, int] = field(default_factory=dict)
    #: the ``--precision`` modes the strategy carries out itself (FSDP's ``MixedPrecisionPolicy``): for them the
    #: run casts nothing and the strategy's ``amp`` adds no autocast and no loss scaler
    own_precision: tuple[str, ...] = ()
    #: why the survivors of a lost worker cannot go on without it under ``--on-failure continue``; None where
    #: they can (each rank a whole replica of the model and optimizer, the exchange rebuilt over fewer ranks)
    lost_worker: str | None = NOT_WHOLE
    #: where ``lost_worker`` is not None: with ``--dp-replicate`` >= 2 a lost rank's shards are taken from the rank
    #: of the same shard index in another replica, so the survivors go on (``fsdp``: HSDP; :mod:`polytrain.train.heal`)
    replicas_heal: bool = False
    #: a model from any factory comes to ``prepare`` on the meta device, each rank making only its part
    #: (:mod:`polytrain.models.replay`)
    builds_part: bool = False
    #: config sections read besides the strategy's own (``pipeline``: ``tp``, for its tp plan)
    reads: tuple[str, ...] = ()
    #: the parameters' copies the strategy keeps besides the model, gradients and optimizer state, for the
    #: memory plan: ``anchor`` (diloco's: the parameters at the last meeting, and its outer momentum)
    copies: tuple[str, ...] = ()
