"""What a launched function gets (:class:`WorkerContext`), what a spawned worker is handed (:class:`Job`), and the
heartbeat's goodbye around the function, shared by spawned and torchrun workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from polytrain.distributed.hangs import is_timeout
from polytrain.distributed.layout import Layout
from polytrain.distributed.stop import StopSignal
from polytrain.distributed.supervisor import describe_exception
from polytrain.devices.memory_limit import memory_error
from polytrain.distributed.topology import Topology


@dataclass(frozen=True)
class WorkerContext:
    """What a launched function gets: where it runs and the group it belongs to."""

    topology: Topology
    #: whether a stop was asked (``stop.requested``: the signal's name), and the ranks' agreement on where
    stop: StopSignal = field(default_factory=StopSignal, compare=False)
    #: the job's layout as the launching process decided it (None: launched without one)
    layout: Layout | None = None
    #: ``--on-failure continue``: this process's membership (:mod:`polytrain.distributed.elastic`); else None
    membership: Any = None

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @property
    def is_main(self) -> bool:
        return self.topology.is_main


@dataclass(frozen=True)
class Job:
    """Everything a spawned worker needs (picklable)."""

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    world_size: int
    device: str
    backend: str
    timeout_s: float
    threads: int
    store_port: int  # set once the store listens
    log_all_ranks: bool
    soft_placement: bool = False
    host_memory: str = "cache"
    #: the launcher's environment at launch, with the workers' own settings: a forkserver child would
    #: otherwise see the environment the forkserver was started with, not the one of this launch
    environ: tuple[tuple[str, str], ...] = ()
    heartbeat_timeout: float = 0.0
    rank_names: tuple[str, ...] | None = None
    expendable: tuple[int, ...] = ()  # ranks the job goes on without (--tolerate-worker-loss)
    orderly_stop: bool = False  # stop signals ask for an orderly stop (ctx.stop) instead of their default
    layout: Layout | None = None
    memory_limit: str | None = None  # --memory-limit, applied in the worker (devices/memory_limit.py)
    preload: tuple[str, ...] = ()  # modules imported before the memory limit is applied (its baseline)
    elastic: bool = False  # --on-failure continue: groups by membership generation (distributed/elastic.py)
    joining: bool = False  # a replacement for a lost worker, admitted by the others at a step boundary


def with_heartbeat(beat: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, then goodbye to the peers' heartbeat watchers; or, if it raised, the error for them."""
    try:
        result = fn(*args)
    except BaseException as exc:
        if is_timeout(exc) and hasattr(beat, "explain"):  # a collective gave up waiting: say who is behind
            beat.explain(f"a collective of this rank timed out ({describe_exception(exc)['message'][:200]})")
        beat.failed(describe_exception(memory_error(exc))["message"])  # the peers log what the launcher reports
        raise
    beat.goodbye()
    return result
