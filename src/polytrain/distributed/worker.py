"""A spawned worker's side of a launch: it never outlives the launcher, takes stop signals as the job asks,
joins the group through the launcher's store, runs the function with a heartbeat, and reports once."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from polytrain.devices.host_memory import set_host_memory
from polytrain.devices.memory_limit import apply_memory_limit, memory_error
from polytrain.devices.spec import resolve_device
from polytrain.distributed import joining
from polytrain.distributed.context import Job, WorkerContext, with_heartbeat
from polytrain.distributed.heartbeat import watch_peers
from polytrain.distributed.lifetime import die_with_parent
from polytrain.distributed.lost import LostRanks
from polytrain.distributed.mp_helpers import release_inherited_forkserver
from polytrain.distributed.rendezvous import connect_store
from polytrain.distributed.stop import STOP_SIGNALS, StopSignal, exit_at_once
from polytrain.distributed.supervisor import describe_exception, send_report
from polytrain.distributed.topology import Topology
from polytrain.log import setup_logging


def _die_with_parent(rank: int) -> None:
    """No worker outlives the launcher, however it ends (SIGKILL included), and none keeps it from ending.

    The kernel kills the forkserver when the launcher dies, and the worker when the forkserver does (Linux's
    parent-death signal; :mod:`.forkserver_init` sets the forkserver's). A worker also inherits the write end
    of the forkserver's "alive" pipe, which would keep the forkserver running after the launcher is gone:
    closed here. A thread watches the launcher's end of the process pipe as well, for a launcher that died
    before the signal was set and for ``spawn`` (the launcher is the parent). Shows as ``polytrain-rN``."""
    release_inherited_forkserver()
    die_with_parent(f"polytrain-r{rank}")
    parent = multiprocessing.parent_process()
    if parent is not None and parent.sentinel is not None:
        threading.Thread(target=_exit_when_gone, args=(parent.sentinel, parent.pid, rank),
                         name="polytrain-launcher-watch", daemon=True).start()


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


def _own_process_group() -> None:
    """This worker leads a process group of its own (POSIX ``setpgid``): a signal to the command's group
    (``timeout``, Ctrl-C, a scheduler) reaches the launching process only, which passes a stop on through the
    store, instead of every worker a second time and, worse, a worker's children (``--compile``'s C++ compiler
    and its compile workers, killed mid-build otherwise). The launcher ends the whole group when it stops the
    worker (:func:`~polytrain.distributed.supervisor.stop_all`)."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpgid(0, 0)


def worker_main(job: Job, rank: int, conn: Any) -> None:
    _die_with_parent(rank)
    _own_process_group()
    if job.environ:
        os.environ.clear()
        os.environ.update(dict(job.environ))
    stop = _set_stop_signals(job.orderly_stop)
    set_host_memory(job.host_memory)
    torch.set_num_threads(job.threads)
    setup_logging(rank, job.world_size, all_ranks=job.log_all_ranks)
    try:
        topology, membership = _init_spawned(job, rank)
        if topology is None:  # a replacement the job ended before admitting (--on-failure continue)
            send_report(conn, "ok", None)
            conn.close()
            return
        if job.orderly_stop:
            stop.connect(lambda: connect_store("127.0.0.1", job.store_port, timedelta(seconds=job.timeout_s)))
        beat = watch_peers("127.0.0.1", job.store_port, rank, job.world_size, job.heartbeat_timeout,
                           connect_timeout=job.timeout_s, names=job.rank_names,
                           report=lambda error: send_report(conn, "error", describe_exception(error)),
                           lost=topology.lost)
        if membership is not None:
            membership.heartbeat_started()

        apply_memory_limit(job.memory_limit, topology.device, rank, preload=job.preload)  # counted from here
        try:
            result = with_heartbeat(beat, job.fn, WorkerContext(topology, stop, job.layout, membership), *job.args)
        finally:
            if dist.is_initialized():  # (not after a membership change that failed between two groups)
                dist.destroy_process_group()
        send_report(conn, "ok", result)
    except BaseException as exc:  # report everything, including SystemExit, to the launcher
        send_report(conn, "error", describe_exception(memory_error(exc)))  # past --memory-limit: one line
        conn.close()
        os._exit(1)
    conn.close()


def _init_spawned(job: Job, rank: int) -> tuple[Topology | None, Any]:
    timeout = timedelta(seconds=job.timeout_s)
    device = resolve_device(job.device, local_rank=rank, soft=job.soft_placement)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    store = connect_store("127.0.0.1", job.store_port, timeout)
    if job.elastic:  # --on-failure continue: the group of a membership generation (distributed/elastic.py)
        membership = joining.start(store, rank, job.world_size, joining=job.joining, backend=job.backend,
                                   device=device, timeout=timeout, lost=LostRanks(job.expendable),
                                   heartbeat_timeout=job.heartbeat_timeout)
        return (membership.topology(), membership) if membership is not None else (None, None)
    dist.init_process_group(job.backend, store=store, rank=rank, world_size=job.world_size, timeout=timeout)
    return Topology(rank, job.world_size, rank, job.world_size, device, job.backend, dist.group.WORLD, timeout,
                    lost=LostRanks(job.expendable)), None
