"""``--on-failure stop|continue``: what a data-parallel job does when a worker dies.

``stop`` (the default): every worker is stopped, and ``--max-restarts`` starts the job again from its latest
checkpoint. ``continue``: the survivors agree on who is left, make a new process group over themselves and go
on from the current step with the same global batch cut into fewer slices; with ``--max-restarts R`` the
launcher starts a replacement for each lost worker (up to R), which the others admit at a step boundary and
hand the model, the optimizer and the data position over the process group (:mod:`polytrain.train.elastic`,
:mod:`polytrain.distributed.elastic`). ``fsdp`` with ``--dp-replicate 2`` or more goes on too, a lost rank's
shards taken from its peer in another replica (:mod:`polytrain.train.heal`), in the layout :func:`members_layout`
gives.

This module holds the option, the checks made before anything starts, and the launch settings that follow.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, replace
from typing import Any

from polytrain.errors import ConfigError
from polytrain.options import option, register_section
from polytrain.strategies.registry import available_strategies, get_declared

CHOICES = ("stop", "continue")


@register_section("on_failure", "what happens when a worker dies", order=86)
@dataclass
class OnFailureConfig:
    on_failure: str = option("stop", "when a worker dies: stop (every worker; --max-restarts starts the job again "
                                     "from its latest checkpoint) or continue (sync, local-sgd, diloco, and "
                                     "fsdp with --dp-replicate 2 or more, whose lost shards are taken from a "
                                     "replica; with --workers N on one machine: when any worker dies, rank 0 "
                                     "included, the others go on from the current step with the same global batch over fewer workers, "
                                     "the lowest surviving rank logging, evaluating and saving; with "
                                     "--max-restarts R a replacement joins, up to R times)", choices=CHOICES)


def continuing(config: Any) -> bool:
    section = getattr(config, "on_failure", None)
    return section is not None and section.on_failure == "continue"


def check_on_failure(config: Any, layout: Any) -> None:
    """One line for a setting ``--on-failure continue`` cannot work with, before anything starts."""
    if not continuing(config):
        return
    from polytrain.strategies.registry import declared_class

    strategy = declared_class(config, layout)  # (the class that runs the degrees: sync --dp-shard 2 is fsdp's)
    traits = strategy.traits
    if traits.lost_worker is not None and not heals(traits, layout):
        if traits.replicas_heal and layout.axis("dp_replicate") > 1:
            more = " ".join(f"--{axis.replace('_', '-')} {size}" for axis, size in _beyond_shards(layout))
            raise ConfigError(f"--on-failure continue: --strategy {strategy.name} with {more}: a lost rank's "
                              f"tensor-parallel pieces are not taken from its replica peer; drop {more.split()[0]}, "
                              "or use --on-failure stop with --max-restarts and checkpoints")
        supported = [name for name in available_strategies() if get_declared(name).traits.lost_worker is None]
        add = "add --dp-replicate 2 (each shard on two workers: a lost one's are taken from its peer), or " \
            if traits.replicas_heal else ""
        raise ConfigError(f"--on-failure continue: --strategy {strategy.name} {traits.lost_worker}; {add}use "
                          f"--on-failure stop with --max-restarts and checkpoints, or --strategy "
                          f"{' | '.join(supported)}")
    if os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None:
        from polytrain.distributed.cluster import scheduler

        where = {"slurm": "under srun rank 0 hosts the rendezvous store, so its death ends the job",
                 "mpi": "under mpirun rank 0 hosts the rendezvous store, so its death ends the job"}.get(
            scheduler() or "", "under torchrun the agent restarts every worker when one dies")
        raise ConfigError(f"--on-failure continue needs polytrain's own launcher (--workers N), whose process "
                          f"holds the rendezvous store and watches the workers: {where}; use --on-failure stop "
                          "with --max-restarts and checkpoints there")
    if layout.processes < 2:
        raise ConfigError("--on-failure continue needs at least 2 workers (--workers N)")
    from polytrain.distributed.launch import resolve_backend

    if resolve_backend(config.launch.backend, config.device.device, soft=config.device.soft_placement) != "gloo":
        raise ConfigError("--on-failure continue needs the gloo backend (CPU workers): a survivor releases a "
                          "collective blocked on a lost peer by closing gloo's connections, which NCCL's are not; "
                          "use --device cpu, or --on-failure stop with --max-restarts")
    if config.launch.heartbeat_timeout <= 0:
        raise ConfigError("--on-failure continue needs the heartbeat (--heartbeat-timeout > 0): a worker that "
                          "stops answering is found by it")


def heals(traits: Any, layout: Any) -> bool:
    """Whether a lost rank's shards are taken from its replica peer (``fsdp --dp-replicate 2``, not cut further)."""
    return traits.replicas_heal and layout.axis("dp_replicate") > 1 and not _beyond_shards(layout)


def _beyond_shards(layout: Any) -> list[tuple[str, int]]:
    """The layout's axes that cut a replica besides ``dp_shard`` (``--tp``)."""
    return [(axis, size) for axis, size in layout.axes if size > 1 and axis not in ("dp_replicate", "dp_shard")]


def members_layout(cls: Any, members: int, launched: int, options: Any) -> Any:
    """The layout of ``members`` ranks after a membership change of a job launched with ``launched`` workers
    (``cls``: the class that runs its degrees, with its options).

    Whole replicas: the class's layout for ``members`` workers. Shards healed from replicas (``fsdp
    --dp-replicate R --dp-shard S``): ``--dp-shard S`` kept and ``--dp-replicate members / S`` where ``S``
    divides ``members`` (so a replacement that makes the launch's number again brings the launch's layout back),
    else one replica sharded over all ``members`` (``--dp-replicate 1 --dp-shard members``), whose next loss
    cannot be healed (:mod:`polytrain.train.heal`)."""
    from polytrain.parallel.degrees import Degrees
    from polytrain.strategies.registry import degrees_layout

    if not cls.traits.replicas_heal:
        return expendable(cls.layout(members, options))
    at_launch = cls.layout(launched, options)
    if members == launched:
        return expendable(at_launch)
    shard = at_launch.axis("dp_shard")
    replicas, shard = (members // shard, shard) if members % shard == 0 else (1, members)
    return expendable(degrees_layout(cls, Degrees(dp_replicate=replicas, dp_shard=shard), at_launch.meets_every))


def launch_settings(config: Any, layout: Any) -> tuple[Any, Any]:
    """The config and layout to launch an ``--on-failure continue`` job with: any worker may be lost (the store
    and the supervision are the launching process's: the layout's ``expendable``, from which ``sync`` averages
    through the process group), and the global batch is fixed in examples (``--worker-batch-size`` times the
    workers at launch)."""
    if not continuing(config):
        return config, layout
    check_on_failure(config, layout)  # (under torchrun the run's checks are skipped: this one is not)
    config = copy.deepcopy(config)
    config.data.batch_size, config.data.worker_batch_size = config.global_batch(layout.slices), None
    return config, expendable(layout)


def expendable(layout: Any) -> Any:
    """``layout`` with every rank expendable, as under ``--on-failure continue`` (an exchange the survivors cannot
    rebuild is not opened: ``sync`` averages through the process group, not shared memory)."""
    return replace(layout, expendable=tuple(range(layout.processes)))
