"""Run a function in N worker processes: spawned on this machine, or joined to torchrun's group.

``launch(fn, workers=N)`` calls ``fn(ctx, *args)`` in every worker, where ``ctx`` is a
:class:`WorkerContext` (rank, world size, device, topology), and returns the workers' return values in
rank order. Three ways in, one result:

* under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` set) the process joins torchrun's group and
  runs ``fn`` once; any node count works;
* ``workers == 1`` runs ``fn`` in this process, without a process group;
* otherwise N processes are spawned, rendezvous through a store that listens on 127.0.0.1 only, and
  are supervised: if one dies, the rest are stopped and the error names the rank.

``expendable`` ranks (``--tolerate-worker-loss``; never rank 0) are the exception, with spawned workers only:
when one dies the others go on, learn of it from their heartbeat through ``ctx.topology.lost``
(:mod:`polytrain.distributed.lost`), and its result is None.

The launching process owns its job: spawned workers die with it (killed or not, at any moment), and
``launch(..., stop=StopSignal())`` makes a signal to it or to any worker a request for an orderly stop that
every worker sees through ``ctx.stop`` (:mod:`polytrain.distributed.stop`); a second signal kills the workers.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polytrain.devices.host_memory import HOST_MEMORY_CHOICES, set_host_memory
from polytrain.devices.spec import QUIET, default_backend, parse_device, resolve_device
from polytrain.distributed.heartbeat import watch_peers
from polytrain.distributed.lifetime import die_with_parent
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.rendezvous import StoreServer, connect_store, gloo_interface, loopback_interface
from polytrain.distributed.stop import STOP_SIGNALS, StopBeforeTraining, StopNow, StopSignal, exit_at_once
from polytrain.distributed.supervisor import describe_exception, send_report, stop_all, supervise
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError, RunStopped
from polytrain.log import setup_logging
from polytrain.options import option, register_section

BACKENDS = ("auto", "gloo", "nccl")


def _check_workers(value: str) -> None:
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise ValueError(f"must be a whole number >= 1 or 'auto', got '{value}'")


@register_section("launch", "workers and launcher", order=60)
@dataclass
class LaunchConfig:
    workers: str = option("2", "worker processes: N, or auto (one per CPU core; one per GPU with --device cuda)",
                          metavar="N|auto", check=_check_workers)
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


_DEFAULT_WORKERS = LaunchConfig.workers  # a device spec naming its workers (cpu:4) overrides this default


@dataclass(frozen=True)
class WorkerContext:
    """What a launched function gets: where it runs and the group it belongs to."""

    topology: Topology
    #: whether a stop was asked (``stop.requested``: the signal's name), and the ranks' agreement on where
    stop: StopSignal = field(default_factory=StopSignal, compare=False)

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
class _Job:
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


#: how workers start: ``forkserver`` forks them from a server that has imported torch and polytrain once
#: (a worker is up in a fraction of a second instead of importing torch anew); ``spawn`` is the fallback
#: for environments where forking is not wanted: set ``POLYTRAIN_START_METHOD=spawn``
START_METHODS = ("forkserver", "spawn")
_PRELOAD = ["polytrain.distributed.forkserver_init", "torch", "torch.distributed", "polytrain.distributed.launch",
            "polytrain.train.trainer"]


def _start_context() -> Any:
    method = os.environ.get("POLYTRAIN_START_METHOD", "forkserver")
    if method not in START_METHODS:
        raise ConfigError(f"POLYTRAIN_START_METHOD={method}: must be one of {', '.join(START_METHODS)}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # only read when the forkserver starts (once per launcher process)
    return ctx


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


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
           expendable: Sequence[int] = (), stop: StopSignal | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` in every worker; return the results in rank order.

    ``workers`` defaults to the count that ``device`` names (``cpu:4``: 4 workers; ``cuda:0,1``: 2), else 1;
    an ``int`` is taken as given, a string is read like ``--workers``. ``device`` is resolved in each worker
    for its local rank; with ``soft_placement`` an unavailable device falls back (to another GPU or the
    CPU) with a warning instead of failing. ``host_memory`` is how each worker's malloc treats freed tensor
    memory (``cache``: kept for reuse; ``release``: glibc's default), see :mod:`polytrain.devices.host_memory`.
    ``rank_names`` says what each rank is when its failure is reported (default "worker rank N").
    ``heartbeat_timeout``: a rank silent this long is reported on every other rank, which then exits
    (:mod:`polytrain.distributed.heartbeat`; 0: off). ``expendable`` ranks (1..N-1) may die without ending
    the job: the others learn of it through ``ctx.topology.lost``, and their result is None; this needs
    spawned workers (not torchrun) and the heartbeat. With one worker it means nothing.

    ``stop``: the caller's :class:`~polytrain.distributed.stop.StopSignal`, with its signal handlers installed
    (:meth:`~polytrain.distributed.stop.StopSignal.handling`): a stop signal to this process or to any worker
    is then a request every worker sees as ``ctx.stop.requested``, which ``fn`` should honour at its next
    step (the trainer does: :mod:`polytrain.distributed.stop`); without it, stop signals keep their default
    effect. Either way the workers never outlive this process.

    ``fn`` must be importable by name (defined at module level) because workers are spawned. A script
    whose functions or classes the workers need (``fn`` itself, a model class) must start the run under
    ``if __name__ == "__main__":``, as with any spawned process.
    """
    if host_memory not in HOST_MEMORY_CHOICES:
        raise ConfigError(f"host_memory must be one of {', '.join(HOST_MEMORY_CHOICES)}, got {host_memory!r}")
    if under_torchrun():
        _check_torchrun_expendable(expendable)
        set_host_memory(host_memory)
        return [_join_torchrun(fn, args, device, backend, timeout, soft_placement, heartbeat_timeout,
                               orderly_stop=stop is not None)]
    if getattr(mp.current_process(), "_inheriting", False):
        raise ConfigError("workers were started from a worker that was still starting: the script starts "
                          "training when imported; put that call under `if __name__ == \"__main__\":`")
    count = resolve_workers(workers, device)
    if count == 1:
        set_host_memory(host_memory)
        return [_run_in_process(fn, args, device, threads_per_worker, log_all_ranks, soft_placement, stop)]
    job = _Job(fn, args, count, device, resolve_backend(backend, device, soft=soft_placement), timeout,
               threads_per_worker or max(1, available_cores() // count), 0, log_all_ranks, soft_placement,
               host_memory, heartbeat_timeout=heartbeat_timeout,
               rank_names=tuple(rank_names) if rank_names else None,
               expendable=_check_expendable(expendable, count, heartbeat_timeout), orderly_stop=stop is not None)
    return _spawn(job, master_port, rank_names, stop)


def _check_torchrun_expendable(expendable: Sequence[int]) -> None:
    if expendable:
        raise ConfigError("--tolerate-worker-loss needs polytrain's own launcher: torchrun's agent stops every "
                          "worker of a machine when one fails; start the job with polytrain train, without torchrun")


def _check_expendable(expendable: Sequence[int], world_size: int, heartbeat_timeout: float) -> tuple[int, ...]:
    """The expendable ranks of a spawned job of ``world_size``, checked."""
    ranks = tuple(sorted(set(int(rank) for rank in expendable)))
    if not ranks:
        return ()
    outside = [rank for rank in ranks if not 1 <= rank < world_size]
    if outside:
        raise ConfigError(f"expendable rank(s) {', '.join(map(str, outside))}: must be in 1..{world_size - 1} "
                          f"(a job of {world_size} processes; rank 0, which logs, evaluates and checkpoints, "
                          "never is expendable)")
    if heartbeat_timeout <= 0:
        raise ConfigError("--tolerate-worker-loss needs the heartbeat: the parameter servers learn that a worker "
                          "died from it; give --heartbeat-timeout > 0")
    return ranks


def _run_in_process(fn: Callable[..., Any], args: tuple[Any, ...], device: str, threads: int | None,
                    log_all_ranks: bool, soft_placement: bool = False, stop: StopSignal | None = None) -> Any:
    setup_logging(0, 1, all_ranks=log_all_ranks)
    if threads:  # only when asked: an in-process run otherwise keeps PyTorch's own choice
        torch.set_num_threads(threads)
    topology = Topology(device=resolve_device(device, soft=soft_placement))
    return fn(WorkerContext(topology, stop if stop is not None else StopSignal()), *args)


def _spawn(job: "_Job", master_port: int | None, rank_names: Sequence[str] | None = None,
           stop: StopSignal | None = None) -> list[Any]:
    _check_devices(job.world_size, job.device, job.backend)
    server = StoreServer(timedelta(seconds=job.timeout_s), "127.0.0.1", master_port or 0)
    ctx = _start_context()
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
            _forkserver_ready(ctx, stop)
            with _worker_environment(job.threads), _script_not_rerun(job):
                job = replace(job, store_port=server.port, environ=tuple(os.environ.items()))
                for rank in range(job.world_size):
                    check()
                    recv, send = ctx.Pipe(duplex=False)
                    proc = ctx.Process(target=_worker_main, args=(job, rank, send), name=f"polytrain-rank{rank}")
                    proc.start()
                    send.close()
                    processes.append(proc)
                    conns.append(recv)
            check()
            return supervise(processes, conns, rank_names, frozenset(job.expendable),
                             wake=(stop.wake_fd, check) if stop is not None else None)
        except StopBeforeTraining as early:
            stop_all(processes)
            raise RunStopped(f"stopped by {early.name} before training began; nothing was lost",
                             signal_name=early.name, signum=early.signum, resumable=True) from None
        except (KeyboardInterrupt, StopNow):
            stop_all(processes)
            raise
        finally:
            server.close()


def _forkserver_ready(ctx: Any, stop: StopSignal | None) -> None:
    """Start the forkserver (it imports torch first: seconds) in a thread, while this one stays ready to
    stop: a signal meanwhile ends the launch at once (no worker exists yet) instead of after the import."""
    if stop is None or ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    # spawned from this (main) thread: the kernel ends the forkserver when the thread that started it ends
    forkserver.ensure_running()
    done = threading.Event()

    def start() -> None:
        with contextlib.suppress(Exception):  # killed at the command's end if the launch was stopped meanwhile
            proc = ctx.Process(target=_ready, name="polytrain-warmup")
            proc.start()
            proc.join()
        done.set()

    threading.Thread(target=start, name="polytrain-forkserver-start", daemon=True).start()
    while not done.wait(0.05):
        stop.check()


def _ready() -> None:
    """The forkserver's first child: nothing to do (it proves the forkserver has imported and forks)."""


def stop_helper_processes(timeout: float = 5.0) -> None:
    """End this process's multiprocessing forkserver and resource tracker now (they would outlive the
    command by seconds otherwise, which a scheduler sees as a job still running). The forkserver holds
    nothing to clean up and may still be importing torch: it is killed; the resource tracker is asked to end
    (it removes what a killed worker left registered) and killed after ``timeout`` seconds. Reaches into
    multiprocessing's own bookkeeping (``_forkserver``, ``_resource_tracker``): the standard library stops
    them only at exit."""
    from multiprocessing import forkserver, resource_tracker

    for owner, pid_attr, fd_attr, grace in ((getattr(forkserver, "_forkserver", None), "_forkserver_pid",
                                             "_forkserver_alive_fd", 0.0),
                                            (getattr(resource_tracker, "_resource_tracker", None), "_pid", "_fd",
                                             timeout)):
        pid, fd = getattr(owner, pid_attr, None), getattr(owner, fd_attr, None)
        if pid is None or fd is None:
            continue
        with contextlib.suppress(OSError):
            os.close(fd)  # its end of the "alive" pipe: the helper exits when every copy is closed
        setattr(owner, fd_attr, None)
        setattr(owner, pid_attr, None)
        _reap(pid, grace)


def _reap(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        time.sleep(0.01)


def _check_devices(count: int, device: str, backend: str) -> None:
    if backend == "nccl":
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible < count:
            raise ConfigError(f"backend nccl needs one GPU per worker: {count} workers, {visible} GPU(s) visible; "
                              "use fewer --workers, or --device cpu --backend gloo")


@contextlib.contextmanager
def _script_not_rerun(job: "_Job") -> Iterator[None]:
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
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


def _die_with_parent(rank: int) -> None:
    """No worker outlives the launcher, however it ends (SIGKILL included), and none keeps it from ending.

    The kernel kills the forkserver when the launcher dies, and the worker when the forkserver does (Linux's
    parent-death signal; :mod:`.forkserver_init` sets the forkserver's). A worker also inherits the write end
    of the forkserver's "alive" pipe, which would keep the forkserver running after the launcher is gone:
    closed here. A thread watches the launcher's end of the process pipe as well, for a launcher that died
    before the signal was set and for ``spawn`` (the launcher is the parent). Shows as ``polytrain-rN``."""
    _release_forkserver()
    die_with_parent(f"polytrain-r{rank}")
    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel, parent.pid, rank),
                         name="polytrain-launcher-watch", daemon=True).start()


def _release_forkserver() -> None:
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", None) is None:  # inherited, not our own server's
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None


def _exit_when_gone(sentinel: int, pid: int | None, rank: int) -> None:
    """Wait until the launcher's end of the process pipe closes (it died), then end this worker on the spot:
    it must not write a checkpoint or anything else for a job nobody owns any more."""
    from multiprocessing.connection import wait

    with contextlib.suppress(Exception):
        wait([sentinel])
    with contextlib.suppress(Exception):
        sys.stderr.write(f"polytrain: worker rank {rank}: the launching process ({pid}) is gone; stopping\n")
        sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _set_stop_signals(orderly: bool) -> StopSignal:
    """This worker's stop signals: requests of an orderly stop (a second one exits at once), or, when the job
    has no orderly stop, their defaults again (Ctrl-C stays the launcher's: it stops the workers)."""
    stop = StopSignal()
    if orderly:
        stop.install(exit_at_once, logging.DEBUG, nudged=True)  # for the worker's whole life (the launcher says so)
    else:
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGINT else signal.SIG_DFL)
    return stop


def _worker_main(job: _Job, rank: int, conn: Any) -> None:
    _die_with_parent(rank)
    if job.environ:
        os.environ.clear()
        os.environ.update(dict(job.environ))
    stop = _set_stop_signals(job.orderly_stop)
    set_host_memory(job.host_memory)
    torch.set_num_threads(job.threads)
    setup_logging(rank, job.world_size, all_ranks=job.log_all_ranks)
    try:
        topology = _init_spawned(job, rank)
        if job.orderly_stop:
            stop.connect(lambda: connect_store("127.0.0.1", job.store_port, timedelta(seconds=job.timeout_s)))
        beat = watch_peers("127.0.0.1", job.store_port, rank, job.world_size, job.heartbeat_timeout,
                           connect_timeout=job.timeout_s, names=job.rank_names,
                           report=lambda error: send_report(conn, "error", describe_exception(error)),
                           lost=topology.lost)
        try:
            result = _with_heartbeat(beat, job.fn, WorkerContext(topology, stop), *job.args)
        finally:
            dist.destroy_process_group()
        send_report(conn, "ok", result)
    except BaseException as exc:  # report everything, including SystemExit, to the launcher
        send_report(conn, "error", describe_exception(exc))
        conn.close()
        os._exit(1)
    conn.close()


def _with_heartbeat(beat: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, then goodbye to the peers' heartbeat watchers; or, if it raised, the error for them."""
    try:
        result = fn(*args)
    except BaseException as exc:
        beat.failed(describe_exception(exc)["message"])
        raise
    beat.goodbye()
    return result


def _init_spawned(job: _Job, rank: int) -> Topology:
    timeout = timedelta(seconds=job.timeout_s)
    device = resolve_device(job.device, local_rank=rank, soft=job.soft_placement)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store("127.0.0.1", job.store_port, timeout)
    dist.init_process_group(job.backend, store=store, rank=rank, world_size=job.world_size, timeout=timeout)
    return Topology(rank, job.world_size, rank, job.world_size, device, job.backend, dist.group.WORLD, timeout,
                    lost=LostRanks(job.expendable))


def _join_torchrun(fn: Callable[..., Any], args: tuple[Any, ...], device: str, backend: str,
                   timeout: float, soft_placement: bool = False, heartbeat_timeout: float = 0.0,
                   orderly_stop: bool = False) -> Any:
    stop = StopSignal()
    if orderly_stop:  # torchrun's agent passes a stop signal on to every worker of its machine
        stop.install(exit_at_once, logging.INFO)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    setup_logging(rank, world)
    if "GLOO_SOCKET_IFNAME" not in os.environ:  # listen only where the peers reach us, not on every interface
        interface = gloo_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    resolved = resolve_device(device, local_rank=local_rank, soft=soft_placement)
    if resolved.type == "cuda":
        torch.cuda.set_device(resolved)
    chosen = backend if backend != "auto" else default_backend(resolved)
    delta = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a restart, and so do the addresses the dead workers published in
        # it: a restarted worker could read one and fail to connect (seen on torch 2.13 with --standalone);
        # keys of this restart's own
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                              timeout=delta)
        store = dist.PrefixStore(f"polytrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
                                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
        dist.init_process_group(chosen, store=store, rank=rank, world_size=world, timeout=delta)
    else:
        dist.init_process_group(chosen, timeout=delta)
    topology = Topology(rank, world, local_rank, local_world, resolved, chosen, dist.group.WORLD, delta)
    # keys of their own per run and per restart: torchrun's store outlives a restart of the workers
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if orderly_stop:  # a machine that alone got the signal (one preempted pod) stops the others too
        stop.connect(lambda: connect_store(address, port, delta), prefix=f"polytrain/stop/{run}")
    beat = watch_peers(address, port, rank, world, heartbeat_timeout, connect_timeout=timeout,
                       prefix=f"polytrain/heartbeat/{run}")
    try:
        return _with_heartbeat(beat, fn, WorkerContext(topology, stop), *args)
    finally:
        dist.destroy_process_group()
