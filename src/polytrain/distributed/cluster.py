"""Workers started by a cluster's own launcher: one Slurm task (``srun``) or one MPI rank (``mpirun``) per worker.

``srun -n 4 polytrain train ...`` and ``mpirun -np 4 polytrain train ...`` start every worker themselves, as
torchrun does. :func:`adopt` reads the scheduler's environment and writes torchrun's names for the same facts
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so such a
process joins its job exactly as a torchrun worker does (:mod:`.torchrun`). What is read:

* Slurm (``srun``, one task per worker): ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``,
  ``SLURM_NODEID`` with ``SLURM_STEP_TASKS_PER_NODE``; the rendezvous host is the first node of
  ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), expanded by :func:`expand_nodelist`. A job
  requeued by Slurm has ``SLURM_RESTART_COUNT`` > 0 and resumes from its latest checkpoint, as a torchrun
  restart does (:mod:`polytrain.train.restart`).
* Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``.
* MPICH / Intel MPI (Hydra's PMI): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.

A job on one machine meets on 127.0.0.1 and listens nowhere else. A job over several machines meets at the
first Slurm node, or at ``MASTER_ADDR`` (MPI has no node list: ``mpirun -x MASTER_ADDR=host``). The port is
``MASTER_PORT`` when set, else one derived from the job's id (the same in every task, another per job).

Nothing is read when torchrun (or a user) already set ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``, when the job has
one task (``srun -n 1 polytrain train --workers 4`` spawns its own workers), or when
``POLYTRAIN_CLUSTER=none``.
"""

from __future__ import annotations

import os
import re
import socket
import zlib
from dataclasses import dataclass
from typing import Callable, MutableMapping

from polytrain.distributed.rendezvous import interface_towards
from polytrain.errors import ConfigError

#: set by :func:`adopt` to the scheduler whose environment was read ("slurm", "mpi")
SCHEDULER_ENV = "POLYTRAIN_CLUSTER"
_TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR")


@dataclass(frozen=True)
class Placement:
    """One process's place in a job started by a scheduler."""

    scheduler: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    peer: str | None = None  # a host of another node of the job (Slurm), to find the interface that reaches it

    def torchrun_env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port), SCHEDULER_ENV: self.scheduler}


_on_failure: list[Callable[[Exception], None]] = []


def on_failure(hook: Callable[[Exception], None] | None) -> None:
    """Call ``hook(error)`` when this task fails for a reason a restart may fix (a peer lost), before it exits;
    None removes it. Slurm's requeue after a failure is one (:mod:`polytrain.train.requeue`)."""
    _on_failure[:] = [hook] if hook is not None else []


def failure_hook() -> Callable[[Exception], None] | None:
    return _on_failure[0] if _on_failure else None


def scheduler() -> str | None:
    """The scheduler whose environment this process adopted ("slurm", "mpi"), or None."""
    value = os.environ.get(SCHEDULER_ENV)
    return value if value in ("slurm", "mpi") else None


def scheduler_threads() -> int:
    """CPU threads for one task: ``SLURM_CPUS_PER_TASK`` when Slurm says, else this machine's cores (those this
    process may run on) shared by its tasks, as the local launcher shares them between its workers."""
    given = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if scheduler() == "slurm" and given.isdigit() and int(given) > 0:
        return int(given)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def slurm_restart_count() -> int:
    """How many times Slurm requeued this job (0: its first run, or not under Slurm)."""
    return _int(os.environ, "SLURM_RESTART_COUNT", 0) if scheduler() == "slurm" else 0


def adopt(environ: MutableMapping[str, str] | None = None) -> Placement | None:
    """Write torchrun's variables from the Slurm or MPI environment into ``environ`` (default ``os.environ``);
    return what was read, or None when this process was not started as one of several tasks."""
    env = os.environ if environ is None else environ
    if env.get(SCHEDULER_ENV) in ("slurm", "mpi"):  # adopted already (a second run in the same process)
        return None
    placement = placement_from(env)
    if placement is not None:
        env.update(placement.torchrun_env())
        if placement.peer and "GLOO_SOCKET_IFNAME" not in env:
            interface = interface_towards(placement.peer)
            if interface:  # gloo on the interface the other nodes are reached by (the first node's own name
                env["GLOO_SOCKET_IFNAME"] = interface  # may resolve to loopback there, as Debian's /etc/hosts has it)
    return placement


def placement_from(env: MutableMapping[str, str]) -> Placement | None:
    """The placement the environment describes, without changing it."""
    if env.get(SCHEDULER_ENV, "").lower() == "none" or all(key in env for key in _TORCHRUN_KEYS):
        return None
    if "TORCHELASTIC_RUN_ID" in env:
        return None
    if "OMPI_COMM_WORLD_SIZE" in env:  # before Slurm: mpirun inside an allocation starts its ranks through srun
        return _mpi(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE", ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"))
    if "SLURM_STEP_NUM_TASKS" in env and "SLURM_PROCID" in env and _slurm_agrees_with_pmi(env):
        return _slurm(env)
    if "PMI_SIZE" in env and "PMI_RANK" in env:
        return _mpi(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", ("PMI_KVSNAME", "PMI_JOBID"))
    return None


def _slurm_agrees_with_pmi(env: MutableMapping[str, str]) -> bool:
    # mpiexec (Hydra) inside an allocation starts one srun task per node, which then starts the ranks: PMI's
    # count is the job's; srun --mpi=pmi2 sets both, and they agree
    return "PMI_SIZE" not in env or env.get("PMI_SIZE") == env.get("SLURM_STEP_NUM_TASKS")


def _slurm(env: MutableMapping[str, str]) -> Placement | None:
    world = _int(env, "SLURM_STEP_NUM_TASKS")
    if world <= 1:
        return None
    rank, local_rank = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID", 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world))
    node = _int(env, "SLURM_NODEID", 0)
    local_world = per_node[node] if node < len(per_node) else 1
    nodes = _int(env, "SLURM_STEP_NUM_NODES", len(per_node))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if "MASTER_ADDR" in env:
        address = env["MASTER_ADDR"]
    elif nodes == 1:
        address = "127.0.0.1"  # one machine: meet on loopback, listen nowhere else
    else:
        hosts = expand_nodelist(nodelist)
        if not hosts:
            raise ConfigError("srun: SLURM_STEP_NODELIST and SLURM_JOB_NODELIST are empty, so the first node is "
                              "unknown; set MASTER_ADDR to the host of task 0")
        address = hosts[0]
    peer = None
    if nodes > 1:
        here = socket.gethostname().split(".")[0]
        peer = next((host for host in expand_nodelist(nodelist) if host.split(".")[0] != here), None)
    # another port per requeue: the last run's may still be held by the kernel (TIME_WAIT)
    port = _port(env, f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
                      f".{env.get('SLURM_RESTART_COUNT', '0')}")
    return Placement("slurm", rank, world, local_rank, local_world, address, port,
                     _int(env, "SLURM_RESTART_COUNT", 0), peer)


def _mpi(env: MutableMapping[str, str], rank_key: str, size_key: str, local_rank_key: str, local_size_key: str,
         job_keys: tuple[str, ...]) -> Placement | None:
    world = _int(env, size_key)
    if world <= 1:
        return None
    rank = _int(env, rank_key)
    local_world, local_rank = _int(env, local_size_key, 0), _int(env, local_rank_key, -1)
    if local_rank < 0 or local_world <= 0:
        raise ConfigError(f"MPI: {size_key} is set but {local_rank_key}/{local_size_key} are not, so this rank's "
                          "place on its machine is unknown; start the job with Open MPI's mpirun or MPICH's "
                          "mpiexec (Hydra), or under torchrun")
    if "MASTER_ADDR" in env:
        address = env["MASTER_ADDR"]
    elif local_world == world:
        address = "127.0.0.1"
    else:
        raise ConfigError(f"mpirun over several machines ({world} ranks, {local_world} on this one): MPI does not "
                          "say where rank 0 runs; pass its host name, e.g. mpirun -x MASTER_ADDR=HOST ...")
    job = next((env[key] for key in job_keys if env.get(key)), "")
    return Placement("mpi", rank, world, local_rank, local_world, address, _port(env, job))


def _port(env: MutableMapping[str, str], job: str) -> int:
    if "MASTER_PORT" in env:
        return _int(env, "MASTER_PORT")
    if not job.strip(".0"):
        return 29500  # torchrun's default
    return 20000 + zlib.crc32(job.encode()) % 20000  # the same in every task of a job, another per job


def _int(env: MutableMapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise ConfigError(f"{key} is not set: this process was started by a scheduler that did not say where "
                              "it belongs; start it with srun, mpirun or torchrun")
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} is not a whole number; the scheduler's environment is not one "
                          "polytrain can read (set POLYTRAIN_CLUSTER=none to ignore it)") from None


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed task counts per node: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise ConfigError(f"tasks per node {spec!r} is not in Slurm's form (e.g. 2(x3),1)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list, expanded as ``scontrol show hostnames`` does:
    ``"gpu[01-03,7],login-a[1-2]-ib"`` -> ``gpu01 gpu02 gpu03 gpu7 login-a1-ib login-a2-ib``."""
    hosts: list[str] = []
    for item in _split_top(nodelist):
        hosts += _expand(item)
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0:
        raise ConfigError(f"node list {text!r} has unbalanced brackets")
    return [item.strip() for item in items if item.strip()]


def _expand(item: str) -> list[str]:
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        return [item]
    prefix, ranges, rest = match.groups()
    out = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ConfigError(f"node list {item!r}: {part!r} is not a number or a range like 01-04")
        width = len(low)
        for number in range(int(low), int(high or low) + 1):
            out += [f"{prefix}{number:0{width}d}{tail}" for tail in _expand(rest)]
    return out
