"""Run a function in N worker processes: spawned on this machine, or joined to torchrun's group.

``launch(fn, workers=N)`` calls ``fn(ctx, *args)`` in every worker, where ``ctx`` is a
:class:`WorkerContext` (rank, world size, device, topology), and returns the workers' return values in
rank order. Three ways in, one result:

* under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) the process joins torchrun's group and
  runs ``fn`` once; any node count works;
* ``workers == 1`` runs ``fn`` in this process, without a process group;
* otherwise N processes are spawned, rendezvous through a store that listens on 127.0.0.1 only, and
  are supervised: if one dies, the rest are stopped and the error names the rank.

``expendable`` ranks (``--tolerate-worker-loss``: never rank 0; ``--on-failure continue``: any rank) are the
exception, with spawned workers only: when one dies the others go on, learn of it from their heartbeat through
``ctx.topology.lost`` (:mod:`polytrain.distributed.lost`), and its result is None. The rendezvous store and the
supervision live in the launching process, so no worker's death takes them.

The launching process owns its job: spawned workers die with it (killed or not, at any moment), and
``launch(..., stop=StopSignal())`` makes a signal to it or to any worker a request for an orderly stop that
every worker sees through ``ctx.stop`` (:mod:`polytrain.distributed.stop`); a second signal kills the workers.

The parts: a spawned worker's side is :mod:`.worker`, a torchrun worker's :mod:`.torchrun`, what both get
:mod:`.context`, and multiprocessing's helper processes (the forkserver, the resource tracker) :mod:`.processes`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.multiprocessing as mp

from polytrain.devices.host_memory import HOST_MEMORY_CHOICES, set_host_memory
from polytrain.devices.memory_limit import limited, parse_size
from polytrain.devices.spec import QUIET, default_backend, parse_device, resolve_device
from polytrain.distributed.cluster import scheduler, scheduler_threads
from polytrain.distributed.context import Job, WorkerContext
from polytrain.distributed.elastic_keys import admitted, close_admission, mark_dead
from polytrain.distributed.layout import Layout
from polytrain.distributed.processes import forkserver_ready, start_context
from polytrain.distributed.rendezvous import StoreServer, connect_store, loopback_interface
from polytrain.distributed.stop import StopBeforeTraining, StopNow, StopSignal
from polytrain.distributed.supervisor import stop_all, supervise
from polytrain.distributed.topology import Topology
from polytrain.distributed.torchrun import check_torchrun_expendable, join_torchrun, under_torchrun
from polytrain.distributed.worker import worker_main
from polytrain.environ import environment
from polytrain.errors import ConfigError, RunStopped
from polytrain.log import get_logger, setup_logging
from polytrain.options import option, register_section

BACKENDS = ("auto", "gloo", "nccl")


def _check_workers(value: str) -> None:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"must be a whole number >= 1 or 'auto', got '{value}'")


@register_section("launch", "workers and launcher", order=60)
@dataclass
class LaunchConfig:
    workers: str | None = option(None, "worker processes: N, or auto (one per CPU core; one per GPU with --device "
                                       "cuda); default 2, or what --device or the strategy's own settings say "
                                       "(hybrid --dp D --pp P: D x P)", metavar="N|auto", check=_check_workers)
    threads_per_worker: int | None = option(None, "CPU threads per worker (default: cores / workers)", minimum=1)
    backend: str = option("auto", "collective backend (auto: nccl when every worker has a GPU, else gloo)",
                          choices=BACKENDS)
    timeout: float = option(300.0, "seconds before the rendezvous or any collective gives up", minimum=1.0,
                            metavar="S")
    heartbeat_timeout: float = option(8.0, "a rank whose heartbeat stops this long is reported dead on every "
                                      "other rank, which exits at once instead of waiting --timeout in a "
                                      "collective (0: off)", minimum=0.0, metavar="S")
    master_port: int | None = option(None, "port of the local rendezvous on 127.0.0.1 (default: a free one)",
                                     minimum=0, metavar="PORT")
    log_all_ranks: bool = option(False, "every rank logs, prefixed [rank N] (default: rank 0 only)")
    host_memory: str = option("cache", "freed CPU tensor memory: cache (kept for reuse, as on GPUs: no page "
                              "faults per step) or release (returned to the system, glibc's default)",
                              choices=HOST_MEMORY_CHOICES)


_DEFAULT_WORKERS = "2"  # what --workers was before it was optional: a device spec naming workers overrides it


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def resolve_workers(workers: str | int | None, device: str) -> int:
    """The number of local workers: ``--workers`` and what the device spec says about it.

    ``auto`` -> one worker per listed or visible GPU (CUDA devices), else per CPU core. A device spec
    that names its workers (``cpu:4``, ``cuda:0,1``) sets the count; an explicit ``--workers`` other than
    the default that disagrees with it is an error. An ``int`` is a count the caller already decided;
    ``None`` (nothing given, from Python) is the device spec's count, else 1.
    """
    if isinstance(workers, int):
        if workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {workers}")
        return workers
    spec = parse_device(device)
    if workers is None:
        return 1 if spec.workers is None else spec.workers
    if spec.workers is not None:
        if workers in ("auto", str(spec.workers), _DEFAULT_WORKERS):
            return spec.workers
        raise ConfigError(f"--workers {workers} and --device {spec.text or spec} ({spec.workers} workers) "
                          f"disagree; give one of them")
    if workers != "auto":
        count = int(workers)
        if count < 1:
            raise ConfigError(f"--workers must be >= 1, got {count}")
        return count
    if spec.type in ("cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return available_cores()


def resolve_backend(backend: str, device: str, *, soft: bool = False) -> str:
    """``auto`` -> nccl when the first local worker's device is a GPU, else gloo.

    With ``soft``, an unavailable device counts as its fallback (without logging: each worker logs its
    own fallback decision); without it, an unavailable device is a DeviceError naming it.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"--backend: unknown backend '{backend}'; accepted: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    return default_backend(resolve_device(device, local_rank=0, soft=soft, log=QUIET))


def launch(fn: Callable[..., Any], *args: Any, workers: int | str | None = None, device: str = "cpu",
           backend: str = "auto", timeout: float = 300.0, threads_per_worker: int | None = None,
           master_port: int | None = None, log_all_ranks: bool = False,
           soft_placement: bool = False, host_memory: str = "cache",
           rank_names: Sequence[str] | None = None, heartbeat_timeout: float = 8.0,
           expendable: Sequence[int] = (), stop: StopSignal | None = None,
           layout: Layout | None = None, memory_limit: str | None = None, elastic: bool = False,
           replacements: int = 0, preload: Sequence[str] = ()) -> list[Any]:
    """Run ``fn(ctx, *args)`` in every worker; return the results in rank order.

    ``workers`` defaults to the count that ``device`` names (``cpu:4``: 4 workers; ``cuda:0,1``: 2), else 1;
    an ``int`` is taken as given, a string is read like ``--workers``. ``device`` is resolved in each worker
    for its local rank; with ``soft_placement`` an unavailable device falls back (to another GPU or the
    CPU) with a warning instead of failing. ``host_memory`` is how each worker's malloc treats freed tensor
    memory (``cache``: kept for reuse; ``release``: glibc's default), see :mod:`polytrain.devices.host_memory`.
    ``rank_names`` says what each rank is when its failure is reported (default "worker rank N").
    ``heartbeat_timeout``: a rank silent this long is reported on every other rank, which then exits
    (:mod:`polytrain.distributed.heartbeat`; 0: off). ``expendable`` ranks (1..N-1; 0 too with ``elastic``) may
    die without ending the job: the others learn of it through ``ctx.topology.lost``, and their result is None;
    this needs spawned workers (not torchrun) and the heartbeat. With one worker it means nothing.

    ``stop``: the caller's :class:`~polytrain.distributed.stop.StopSignal`, with its signal handlers installed
    (:meth:`~polytrain.distributed.stop.StopSignal.handling`): a stop signal to this process or to any worker
    is then a request every worker sees as ``ctx.stop.requested``, which ``fn`` should honour at its next
    step (the trainer does: :mod:`polytrain.distributed.stop`); without it, stop signals keep their default
    effect. Either way the workers never outlive this process.

    ``layout``: the job's :class:`~polytrain.distributed.layout.Layout`, decided before launch: its process
    count, rank names and expendable ranks stand for ``workers``, ``rank_names`` and ``expendable``, and every
    worker finds it as ``ctx.layout``.

    ``memory_limit``: ``--memory-limit`` (``"600MiB"``), applied in each worker, and in this process around
    ``fn`` when it runs here (restored after): :mod:`polytrain.devices.memory_limit`; the modules named in
    ``preload`` are imported before it is, so that they count in the baseline.

    ``elastic`` (``--on-failure continue``): every worker's group is that of a membership that may shrink and
    grow (:mod:`polytrain.distributed.elastic`); the expendable ranks' deaths are marked in the store at once, and
    up to ``replacements`` of them are replaced by a new process for the same rank, which the others admit.

    ``fn`` should be importable by name (defined at module level): workers are started afresh. A script
    whose functions or classes the workers need (``fn`` itself, a model class) must start the run under
    ``if __name__ == "__main__":``, as with any spawned process. A function no fresh process can import (defined
    in ``python -c``, a REPL or a notebook) runs in workers forked from this process, on Linux
    (:func:`~polytrain.distributed.processes.start_context`).
    """
    if host_memory not in HOST_MEMORY_CHOICES:
        raise ConfigError(f"host_memory must be one of {', '.join(HOST_MEMORY_CHOICES)}, got {host_memory!r}")
    if memory_limit is not None:
        try:
            parse_size(memory_limit)
        except ValueError as exc:
            raise ConfigError(f"--memory-limit: {exc}") from None
    if layout is not None:
        workers, expendable = layout.processes, layout.expendable
        rank_names = [layout.name(rank) for rank in range(layout.processes)] if layout.names else rank_names
    if under_torchrun():
        check_torchrun_expendable(expendable)
        set_host_memory(host_memory)
        local = resolve_device(device, local_rank=int(os.environ.get("LOCAL_RANK", 0)), soft=soft_placement,
                               log=QUIET)
        if scheduler() is not None:  # srun / mpirun start every task with all the cores: share them as we would
            torch.set_num_threads(threads_per_worker or scheduler_threads())
        with limited(memory_limit, local, int(os.environ["RANK"]), preload):  # this process is the worker
            return [join_torchrun(fn, args, device, backend, timeout, soft_placement, heartbeat_timeout,
                                   orderly_stop=stop is not None, layout=layout)]
    if getattr(mp.current_process(), "_inheriting", False):
        raise ConfigError("workers were started from a worker that was still starting: the script starts "
                          "training when imported; put that call under `if __name__ == \"__main__\":`")
    count = resolve_workers(workers, device)
    if count == 1:
        set_host_memory(host_memory)
        return [_run_in_process(fn, args, device, threads_per_worker, log_all_ranks, soft_placement, stop, layout,
                                memory_limit, tuple(preload))]
    job = Job(fn, args, count, device, resolve_backend(backend, device, soft=soft_placement), timeout,
               threads_per_worker or max(1, available_cores() // count), 0, log_all_ranks, soft_placement,
               host_memory, heartbeat_timeout=heartbeat_timeout,
               rank_names=tuple(rank_names) if rank_names else None,
               expendable=_check_expendable(expendable, count, heartbeat_timeout, elastic),
               orderly_stop=stop is not None,
               layout=layout, memory_limit=memory_limit, elastic=elastic, preload=tuple(preload))
    return _spawn(job, master_port, rank_names, stop, replacements)


def _check_expendable(expendable: Sequence[int], world_size: int, heartbeat_timeout: float,
                      elastic: bool = False) -> tuple[int, ...]:
    """The expendable ranks of a spawned job of ``world_size``, checked; with ``elastic`` (``--on-failure
    continue``: the members agree on who logs, evaluates and checkpoints after a loss) rank 0 may be one."""
    ranks = tuple(sorted(set(int(rank) for rank in expendable)))
    if not ranks:
        return ()
    outside = [rank for rank in ranks if not (0 if elastic else 1) <= rank < world_size]
    if outside:
        raise ConfigError(f"expendable rank(s) {', '.join(map(str, outside))}: must be in 1..{world_size - 1} "
                          f"(a job of {world_size} processes; rank 0, which logs, evaluates and checkpoints, "
                          "never is expendable)")
    if heartbeat_timeout <= 0:
        raise ConfigError("--tolerate-worker-loss needs the heartbeat: the parameter servers learn that a worker "
                          "died from it; give --heartbeat-timeout > 0")
    return ranks


def _run_in_process(fn: Callable[..., Any], args: tuple[Any, ...], device: str, threads: int | None,
                    log_all_ranks: bool, soft_placement: bool = False, stop: StopSignal | None = None,
                    layout: Layout | None = None, memory_limit: str | None = None,
                    preload: tuple[str, ...] = ()) -> Any:
    setup_logging(0, 1, all_ranks=log_all_ranks)
    callers_threads = torch.get_num_threads()
    if threads:  # only when asked: an in-process run otherwise keeps PyTorch's own choice
        torch.set_num_threads(threads)
    try:
        topology = Topology(device=resolve_device(device, soft=soft_placement))
        with limited(memory_limit, topology.device, 0, preload):  # this process's own limit again after the run
            return fn(WorkerContext(topology, stop if stop is not None else StopSignal(), layout), *args)
    finally:
        if torch.get_num_threads() != callers_threads:  # and the caller's own thread count
            torch.set_num_threads(callers_threads)


def _spawn(job: "Job", master_port: int | None, rank_names: Sequence[str] | None = None,
           stop: StopSignal | None = None, replacements: int = 0) -> list[Any]:
    _check_devices(job.world_size, job.device, job.backend)
    server = StoreServer(timedelta(seconds=job.timeout_s), "127.0.0.1", master_port or 0)
    ctx = start_context(job)
    if ctx.get_start_method() == "fork" and job.threads > 1:  # GNU OpenMP's threads do not survive a fork
        get_logger().warning(f"launch: workers forked from this process compute on 1 CPU thread each, not "
                             f"{job.threads}: OpenMP cannot start threads again in a fork of a process that has "
                             "used them; a function in a file gets its threads")
        job = replace(job, threads=1)
    processes, conns = [], []
    if stop is not None and stop.requested:
        server.close()
        raise RunStopped(f"stopped by {stop.requested} before any worker started; nothing was lost",
                         signal_name=stop.requested, signum=stop.signum, resumable=True)
    if stop is not None:  # this process's request reaches every worker through the store
        stop.connect(lambda: connect_store("127.0.0.1", server.port, timedelta(seconds=job.timeout_s)), watch=False,
                     launcher=lambda: [proc.pid for proc in processes if proc.is_alive()])
    deferring = stop.deferring() if stop is not None else contextlib.nullcontext()
    check = stop.check if stop is not None else (lambda: None)
    # a signal's "at once" is raised by check(): between starts and in supervise, never inside a start
    with deferring:
        try:
            forkserver_ready(ctx, stop)
            with _worker_environment(job.threads), _script_not_rerun(job):
                job = replace(job, store_port=server.port, environ=tuple(os.environ.items()))
                for rank in range(job.world_size):
                    check()
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=worker_main, args=(job, rank, send), name=f"polytrain-rank{rank}")
                    proc.start()
                    send.close()
                    processes.append(proc)
                    conns.append(recv)
            check()
            return supervise(processes, conns, rank_names, frozenset(job.expendable),
                             wake=(stop.wake_fd, check) if stop is not None else None,
                             replace=_elastic_replacements(job, ctx, server, replacements) if job.elastic else None)
        except StopBeforeTraining as early:
            stop_all(processes)
            raise RunStopped(f"stopped by {early.name} before training began; nothing was lost",
                             signal_name=early.name, signum=early.signum, resumable=True) from None
        except (KeyboardInterrupt, StopNow):
            stop_all(processes)
            raise
        finally:
            server.close()


def _elastic_replacements(job: "Job", ctx: Any, server: StoreServer, budget: int) -> Callable[[int], Any]:
    """``--on-failure continue``: for each lost rank, say so in the store (the survivors need not wait for the
    heartbeat) and, while ``budget`` lasts, start a replacement process for it: ``(process, pipe)`` or None.
    Once no member is left (every rank lost, or replaced by a process not admitted yet), the replacements waiting
    are told to leave, so that the job ends (or restarts) at once rather than after --timeout."""
    left, gone, joining = [budget], set(), set()

    def lost(rank: int) -> tuple[Any, Any] | None:
        if server.store is not None:
            mark_dead(server.store, rank)
        gone.add(rank)
        joining.discard(rank)
        if left[0] <= 0:
            if server.store is not None and len(gone) + len(joining) == job.world_size \
                    and not any(admitted(server.store, r) for r in joining):
                close_admission(server.store)
            return None
        left[0] -= 1
        gone.discard(rank)
        joining.add(rank)
        with _worker_environment(job.threads), _script_not_rerun(job):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, args=(replace(job, joining=True), rank, send),
                               name=f"polytrain-rank{rank}")
            proc.start()
            send.close()
        return proc, recv

    return lost


def _check_devices(count: int, device: str, backend: str) -> None:
    if backend == "nccl":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < count:
            raise ConfigError(f"backend nccl needs one GPU per worker: {count} workers, {visible} GPU(s) visible; "
                              "use fewer --workers, or --device cpu --backend gloo")


@contextlib.contextmanager
def _script_not_rerun(job: "Job") -> Iterator[None]:
    """Spare spawned workers from re-running the user's script when they need nothing defined in it.

    A spawned worker normally re-imports ``__main__`` so that functions and classes defined there unpickle;
    a script that calls ``fit()`` without an ``if __name__ == "__main__":`` guard would then start training
    again inside every worker. When nothing sent to the workers refers to ``__main__``, hiding the script
    from ``multiprocessing`` for the duration of ``start()`` makes such plain scripts work.
    """
    main = sys.modules.get("__main__")
    try:
        needs_main = b"__main__" in pickle.dumps(job)
    except Exception:  # let multiprocessing report what cannot be pickled, in its own words
        needs_main = True
    if main is None or needs_main:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            main.__dict__.pop("__spec__", None)


@contextlib.contextmanager
def _worker_environment(threads: int) -> Iterator[None]:
    """Environment the spawned workers inherit: thread counts, and gloo pinned to loopback."""
    values = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        values["GLOO_SOCKET_IFNAME"] = loopback_interface()
    with environment(values):
        yield

