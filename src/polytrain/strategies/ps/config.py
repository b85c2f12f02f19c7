"""``async``'s settings (``--servers``, ``--staleness``, ``--overlap``, ``--tolerate-worker-loss``) and ``async``
as declared (:mod:`polytrain.strategies.declared`): imported by the command line without :mod:`.strategy`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.distributed.layout import Layout
from polytrain.errors import ConfigError
from polytrain.options import option, register_section
from polytrain.strategies.declared import DEFAULT_WORKERS, Declared
from polytrain.strategies.ps.ranks import Ranks
from polytrain.strategies.registry import declare, degrees_of, runner_for
from polytrain.strategies.traits import Traits


@register_section("async", "strategy async (parameter servers)", order=71)
@dataclass
class AsyncConfig:
    servers: int = option(1, "async: parameter server processes, started besides the --workers (ranks after "
                             "theirs). --batch-size counts one step: N slices of batch/N examples, each computed "
                             "by whichever worker is free and applied alone, scaled by 1/N; --steps counts "
                             "such steps over all workers", minimum=1, metavar="S")
    staleness: int | None = option(None, "async: no worker starts step c+K+1 before every worker finished step c "
                                         "(0: bulk synchronous; leave out for fully asynchronous)", minimum=0,
                                   metavar="K")
    overlap: bool = option(False, "async: pull the next slice's parameters while this slice computes and push "
                                  "its gradient without waiting (one push in flight): hides the exchange, and "
                                  "every gradient is about one slice staler (lower the momentum). Not with "
                                  "--staleness 0 or --tolerate-worker-loss")
    ps_comm: str = option("auto", "async: how gradients and values travel between workers and servers: shm "
                                  "(shared memory, every rank on one x86-64 Linux machine), backend (gloo "
                                  "messages), or auto (shm where it applies)", choices=("auto", "shm", "backend"))
    tolerate_worker_loss: bool = option(False, "async: go on without workers 1..N-1 if they die (their slices "
                                               "go to the others); worker 0 alone logs, evaluates and saves, and "
                                               "the servers must live")


@declare
class AsyncDeclared(Declared):
    name = "async"
    summary = "asynchronous data parallel: parameter servers apply each worker's gradient as it arrives"
    traits = Traits(exchange="async", meeting="through parameter servers: each worker pushes its gradients and "
                                              "pulls the parameters")
    config_section = "async"

    @classmethod
    def layout(cls, workers: int | None, options: Any = None) -> Layout:
        """Workers first (ranks 0..N-1), then the servers. Each step is N slices, whoever computes them; the
        workers meet only at the trainer's log points. With ``--tolerate-worker-loss`` worker 0 alone runs the
        trainer's loop and workers 1..N-1 are helpers the job may lose."""
        opts = options if options is not None else AsyncConfig()
        runner_for(cls, degrees_of(cls, workers, options))  # whole replicas only: one line for a cut one
        if opts.overlap and (opts.staleness == 0 or opts.tolerate_worker_loss):
            raise ConfigError("--overlap reads the next slice's parameters before this slice's gradient is applied, "
                              + ("which --staleness 0 forbids (every slice of a step on the same parameters); use "
                                 "--staleness 1 or more, or drop --overlap" if opts.staleness == 0 else
                                 "and --tolerate-worker-loss hands a lost worker's slices out again one at a time; "
                                 "drop one of them"))
        ranks = Ranks(workers or DEFAULT_WORKERS, opts.servers)
        n = ranks.workers
        tolerant = bool(opts.tolerate_worker_loss) and n > 1
        roles = ["helper" if tolerant and 0 < rank < n else ranks.role(rank) for rank in range(ranks.world_size)]
        trainers = roles.count("trainer")
        return Layout(cls.name, tuple(roles), (("dp", trainers),), n,
                      names=tuple(ranks.name(rank) for rank in range(ranks.world_size)),
                      expendable=tuple(range(1, n)) if opts.tolerate_worker_loss else (), meets_every=0)
