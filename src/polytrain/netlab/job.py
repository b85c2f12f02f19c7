"""One job across a lab's nodes: ``torchrun`` in every node's namespace, one worker process each.

Node 0 hosts torchrun's static rendezvous store on its own address; node i is torchrun's node rank i, so
its worker is rank i (``--straggler 1:2`` slows node 1's). Both torchrun flags that namespaces on one
machine need are given: ``--local-addr`` (the nodes share one hostname, so each advertises its address) and
static rendezvous (the store's node is known, so it hosts the store). Gloo is pinned to the node's end of
the link (``GLOO_SOCKET_IFNAME``): every byte between ranks crosses the rate-limited links.

When one node's torchrun fails (a worker killed, an error), the others get ``grace_s`` to end on their own
(polytrain's heartbeat names the lost rank) and are then killed, so a job never outlives its first failure
by more than that; the lab itself is removed by its owner (``with NetLab(...)``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from polytrain.netlab.lab import NetLab, empty

STORE_PORT = 29500  # inside node 0's namespace, where nothing else listens


@dataclass
class JobResult:
    codes: list[int | None]  # each node's torchrun exit code (None: killed after the first failure or timeout)
    wall_s: float
    tx_bytes: list[int]  # what each node sent over its link during the job
    rx_bytes: list[int]
    logs: list[Path] = field(default_factory=list)  # each node's stdout+stderr

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def log(self, node: int) -> str:
        return self.logs[node].read_text(errors="replace") if node < len(self.logs) else ""


def torchrun_argv(lab: NetLab, node: int, args: Sequence[str], *, run_id: str, port: int = STORE_PORT,
                  module: str = "polytrain") -> list[str]:
    """The torchrun command line of node ``node`` (run it in that node's namespace: :meth:`NetLab.command`)."""
    nodes = lab.nodes
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(nodes)), "--nproc-per-node", "1",
            "--node-rank", str(node), "--rdzv-backend", "static", "--rdzv-id", run_id,
            "--master-addr", nodes[0].address, "--master-port", str(port), "--local-addr", nodes[node].address,
            "--max-restarts", "0", "-m", module, *args]


def node_env(lab: NetLab, base: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """The environment of every node's torchrun: gloo on the link, CPU threads shared out among the nodes."""
    env = dict(os.environ if base is None else base)
    env["GLOO_SOCKET_IFNAME"] = lab.nodes[0].interface
    if threads is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        threads = max(1, cores // len(lab.nodes))
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_job(lab: NetLab, args: Sequence[str], logs: Path, *, run_id: str, timeout_s: float = 3600.0,
            grace_s: float = 15.0, env: dict[str, str] | None = None, threads: int | None = None,
            started: "list[subprocess.Popen] | None" = None,
            poll: Callable[[], None] | None = None) -> JobResult:
    """Run ``python -m polytrain ARGS`` as one job over every node of ``lab`` and wait for it.

    Each node's output goes to ``logs/node<i>.log``. ``started``, if given, receives the node processes as
    they start (a test kills one); ``poll`` is called about every 0.1 s while the job runs (keep it cheap: it
    shares the machine with the job). Killed after ``timeout_s`` in all; after the first failure the others get
    ``grace_s``. The processes are gone when this returns or raises (Ctrl-C included).
    """
    logs.mkdir(parents=True, exist_ok=True)
    environment = node_env(lab, env, threads)
    tx0 = [lab.tx_bytes(i) for i in range(len(lab.nodes))]
    rx0 = [lab.rx_bytes(i) for i in range(len(lab.nodes))]
    procs: list[subprocess.Popen] = [] if started is None else started
    paths = [logs / f"node{i}.log" for i in range(len(lab.nodes))]
    begin = time.monotonic()
    try:
        for i in range(len(lab.nodes)):
            with open(paths[i], "w") as out:
                procs.append(lab.popen(i, torchrun_argv(lab, i, args, run_id=run_id), stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environment))
        deadline, failed_at = begin + timeout_s, None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if now > deadline or (failed_at is not None and now - failed_at > grace_s):
                break
            if poll is not None:
                poll()
            time.sleep(0.1)
        wall = time.monotonic() - begin
        codes = [p.poll() for p in procs]
        if poll is not None:
            poll()  # once more: what the job wrote just before it ended
    finally:
        for node in lab.nodes:  # whatever is still running: nothing of the job outlives this call
            empty(node.namespace)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
    tx = [lab.tx_bytes(i) - tx0[i] for i in range(len(lab.nodes))]
    rx = [lab.rx_bytes(i) - rx0[i] for i in range(len(lab.nodes))]
    return JobResult(codes, wall, tx, rx, paths)
