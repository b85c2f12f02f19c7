"""Joining torchrun's process group: a worker that torchrun started (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
set) runs the function once in torchrun's group, with polytrain's heartbeat and stop signals over its store.
A task of ``srun`` or ``mpirun`` joins the same way, once :mod:`.cluster` has written torchrun's variables
from the scheduler's; its rank 0 hosts the store."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from polytrain.devices.spec import default_backend, resolve_device
from polytrain.distributed.context import WorkerContext, with_heartbeat
from polytrain.distributed.heartbeat import watch_peers
from polytrain.distributed.layout import Layout
from polytrain.distributed.cluster import failure_hook, scheduler
from polytrain.distributed.rendezvous import StoreServer, connect_store, gloo_interface, is_loopback
from polytrain.distributed.stop import StopSignal, exit_at_once
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError
from polytrain.log import setup_logging


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def check_torchrun_expendable(expendable: Sequence[int]) -> None:
    if expendable:
        raise ConfigError("--tolerate-worker-loss needs polytrain's own launcher: torchrun's agent stops every "
                          "worker of a machine when one fails; start the job with polytrain train, without torchrun")


def join_torchrun(fn: Callable[..., Any], args: tuple[Any, ...], device: str, backend: str,
                   timeout: float, soft_placement: bool = False, heartbeat_timeout: float = 0.0,
                   orderly_stop: bool = False, layout: Layout | None = None) -> Any:
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
    server = None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent store outlives a restart, and so do the addresses the dead workers published in
        # it: a restarted worker could read one and fail to connect (seen on torch 2.13 with --standalone);
        # keys of this restart's own
        agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, is_master=False,
                              timeout=delta)
        store = dist.PrefixStore(f"polytrain/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/"
                                 f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", agent)
        dist.init_process_group(chosen, store=store, rank=rank, world_size=world, timeout=delta)
    elif scheduler() is not None:  # srun / mpirun: rank 0 hosts the store on the rendezvous address only
        server = scheduler_store(rank, delta)
        store = server.store if server is not None else connect_store(os.environ["MASTER_ADDR"],
                                                                       int(os.environ["MASTER_PORT"]), delta)
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
                       prefix=f"polytrain/heartbeat/{run}", report=failure_hook())  # (Slurm: requeue first)
    try:
        return with_heartbeat(beat, fn, WorkerContext(topology, stop, layout), *args)
    finally:
        dist.destroy_process_group()
        if server is not None:
            server.close()


def scheduler_store(rank: int, timeout: timedelta) -> StoreServer | None:
    """Rank 0's rendezvous store under srun or mpirun, bound to ``MASTER_ADDR`` alone (None on other ranks)."""
    if rank != 0:
        return None
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    try:
        bind = socket.gethostbyname(address)
    except OSError as exc:
        raise ConfigError(f"rank 0 cannot find the rendezvous host {address}: {exc}; set MASTER_ADDR to the "
                          "host of rank 0") from None
    several = int(os.environ.get("WORLD_SIZE", "1")) > int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if several and is_loopback(bind):  # a node's own name that resolves to 127.0.1.1 here (Debian's /etc/hosts),
        bind = "0.0.0.0"               # but to its network address on the other nodes: listen where they reach it
    try:
        return StoreServer(timeout, bind, port)
    except ConfigError as exc:
        raise ConfigError(f"rank 0 cannot host the rendezvous at {address}:{port} ({exc}); set MASTER_PORT to "
                          "a free port, and MASTER_ADDR to the host rank 0 runs on") from None
