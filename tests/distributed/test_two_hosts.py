"""Two hosts on one machine: two network namespaces joined by a veth pair, one torchrun node in each.

Each namespace has only loopback and its end of the veth pair, with an address in a /24 that nothing else
uses; the test creates both namespaces with unique names and deletes them afterwards, killing whatever still
runs inside them first (a torchrun worker runs in a session of its own, so killing the agent's process
group would leave it behind; ``ip netns pids`` finds it). Where namespaces cannot be created (not root, no
``ip``, no CAP_NET_ADMIN) the tests are skipped with the reason.

The namespaces share one hostname, so torchrun needs ``--rdzv-conf is_host=true`` on the node that hosts the
store and ``--local-addr`` on both; they also share /dev/shm, so ``--comm backend`` makes ``sync`` send the
gradients over the link instead of averaging them through shared memory (README, "Two machines").
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import torch

import polytrain
from tests.helpers.procs import alive, cmdline

# two torchrun agents and their workers start per test (~20-40 s on 2 cores)
pytestmark = pytest.mark.slow

#: the /24 the two ends of the link get; used only inside the namespaces this module creates
SUBNET = ipaddress.ip_network("10.231.7.0/24")
STORE_PORT = 29500  # inside node A's namespace: nothing else listens there
TRAIN = ["--model", "mlp", "--data", "digits", "--batch-size", "64", "--seed", "1", "--comm", "backend"]


@dataclass
class Node:
    namespace: str
    interface: str
    address: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def _pids_in(namespace: str) -> list[int]:
    proc = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _empty_namespace(namespace: str, timeout: float = 30.0) -> list[int]:
    """SIGKILL every process in ``namespace`` (all of them were started by this test) until none is left;
    returns those that outlived ``timeout``. SIGKILL, because torchrun's agent blocked in a store call does
    not act on SIGTERM."""
    deadline = time.monotonic() + timeout
    while True:
        pids = alive(_pids_in(namespace))
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _skip_reason() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are a Linux feature"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2) to create network namespaces"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for line in _ip("-4", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if words[:1] == ["inet"] and ipaddress.ip_interface(words[1]).network.overlaps(SUBNET):
            return f"this machine already uses {SUBNET}, which the test reserves for its own namespaces"
    return None


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[Node, Node]]:
    """Namespaces A and B joined by a veth pair (A: .1, B: .2); gone afterwards whatever happened."""
    token = f"{os.getpid()}{uuid.uuid4().hex[:4]}"
    a = Node(f"polytrain-{token}-a", f"pt{token}a", str(SUBNET.network_address + 1))
    b = Node(f"polytrain-{token}-b", f"pt{token}b", str(SUBNET.network_address + 2))
    created: list[str] = []
    try:
        for node in (a, b):
            proc = _ip("netns", "add", node.namespace, check=False)
            if proc.returncode != 0:
                pytest.skip(f"cannot create a network namespace here: {proc.stderr.strip()}")
            created.append(node.namespace)
        _ip("link", "add", a.interface, "type", "veth", "peer", "name", b.interface)
        for node in (a, b):
            _ip("link", "set", node.interface, "netns", node.namespace)
            _ip("-n", node.namespace, "addr", "add", f"{node.address}/{SUBNET.prefixlen}", "dev", node.interface)
            _ip("-n", node.namespace, "link", "set", "lo", "up")
            _ip("-n", node.namespace, "link", "set", node.interface, "up")
        probe = subprocess.run(["ip", "netns", "exec", a.namespace, "true"], capture_output=True, text=True,
                               timeout=30)
        if probe.returncode != 0:  # e.g. a container that may create namespaces but not mount /run/netns
            pytest.skip(f"cannot run a command inside a network namespace: {probe.stderr.strip()}")
        yield a, b
    finally:
        survivors = {ns: _empty_namespace(ns) for ns in created}
        for ns in created:
            _ip("netns", "del", ns, check=False)  # its end of the veth pair goes with it
        # still in this namespace if moving it failed; deleting one end deletes the pair
        _ip("link", "del", a.interface, check=False)
        assert not any(survivors.values()), f"processes that SIGKILL did not end: {survivors}"


@pytest.fixture
def hosts():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    with two_hosts() as pair:
        yield pair


def start_node(node: Node, store: Node, run_id: str, args: list[str], logs: Path, env: dict) -> subprocess.Popen:
    """``torchrun`` for one node of two in ``node``'s namespace; ``store`` hosts the rendezvous store."""
    rdzv = ["--rdzv-conf", "is_host=true"] if node is store else []  # both share one hostname
    cmd = ["ip", "netns", "exec", node.namespace, sys.executable, "-m", "torch.distributed.run",
           "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"{store.address}:{STORE_PORT}", *rdzv, "--local-addr", node.address,
           "--rdzv-id", run_id, "-m", "polytrain", "train", *args]
    name = node.namespace.rsplit("-", 1)[1]
    with open(logs / f"{name}.out", "w") as out, open(logs / f"{name}.err", "w") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)


def read(logs: Path, name: str) -> str:
    return (logs / f"{name}.out").read_text() + (logs / f"{name}.err").read_text()


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [proc.poll() for proc in procs]


def test_sync_across_two_hosts_equals_single(hosts, cli_env, tmp_path):
    a, b = hosts
    args = ["--strategy", "sync", "--steps", "5", "--progress", "lines", "--timeout", "60", *TRAIN]
    args += ["--save-model", str(tmp_path / "sync.pt")]
    run_id = f"parity-{uuid.uuid4().hex[:8]}"  # one job: the same id on both nodes
    procs = [start_node(node, a, run_id, args, tmp_path, cli_env) for node in (a, b)]
    codes = wait_all(procs, timeout=180)
    assert codes == [0, 0], read(tmp_path, "a") + read(tmp_path, "b")
    out_a = read(tmp_path, "a")
    assert "2 processes (1 on this machine" in out_a and "done: 5 steps" in out_a, out_a
    assert "gradients averaged through the process group's all-reduce" in out_a, out_a

    polytrain.fit(model="mlp", data="digits", strategy="single", steps=5, batch_size=64, seed=1, progress="off",
                  save_model=str(tmp_path / "single.pt"))
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    sync = torch.load(tmp_path / "sync.pt", weights_only=True)
    assert single.keys() == sync.keys()
    for name in single:
        rel = (single[name] - sync[name]).norm() / single[name].norm().clamp_min(1e-12)
        assert rel <= 1e-5, (name, rel.item())


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of the TCP sockets ``pid`` listens on, read from its own network namespace's tables."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/{pid}/net/{table}") as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    host, port = fields[1].split(":")
                    raw = bytes.fromhex(host)
                    # /proc prints each 32-bit word of the address in host (little-endian) order
                    words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
                    out.append((str(ipaddress.ip_address(words)), int(port, 16)))
    return out


def _workers(namespace: str) -> list[int]:
    return [p for p in alive(_pids_in(namespace)) if "polytrain train" in cmdline(p)
            and "torch.distributed.run" not in cmdline(p)]


# a lost machine is named within ~10-20 s (--heartbeat-timeout's default is 8 s); the test waits for the event, so a
# wide bound (slack for the other pytest -n worker beside it) costs nothing when it comes
DETECTION_BOUND_S = 45.0
EXIT_BOUND_S = 60.0  # the node's torchrun agent, once its worker ended: it reaps it and closes the rendezvous


def test_a_cut_link_ends_both_nodes_naming_the_lost_peer(hosts, cli_env, tmp_path):
    a, b = hosts
    args = ["--strategy", "sync", "--steps", "100000", "--log-every", "10", "--progress", "lines",
            "--timeout", "300", *TRAIN]
    run_id = f"cut-{uuid.uuid4().hex[:8]}"
    procs = [start_node(node, a, run_id, args, tmp_path, cli_env) for node in (a, b)]
    deadline = time.monotonic() + 120
    while "step 10/" not in read(tmp_path, "a"):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
            read(tmp_path, "a") + read(tmp_path, "b")
        time.sleep(0.2)

    # while training: each worker listens on its own end of the link only, never on every interface
    for node in (a, b):
        workers = _workers(node.namespace)
        assert len(workers) == 1, [cmdline(p) for p in alive(_pids_in(node.namespace))]
        addresses = {address for address, _ in _listening(workers[0])}
        assert addresses == {node.address}, (node, addresses)

    _ip("-n", b.namespace, "link", "set", b.interface, "down")
    cut = time.monotonic()
    ended: dict[str, float] = {}
    while len(ended) < 2 and time.monotonic() - cut < EXIT_BOUND_S:
        for name, node in (("a", a), ("b", b)):
            if name not in ended and not _workers(node.namespace):
                ended[name] = time.monotonic() - cut
        time.sleep(0.2)
    codes = wait_all(procs, timeout=max(0.1, EXIT_BOUND_S - (time.monotonic() - cut)))
    out_a, out_b = read(tmp_path, "a"), read(tmp_path, "b")

    # node A hosts the store: its worker sees rank 1's heartbeat stop
    assert ended.get("a", float("inf")) <= DETECTION_BOUND_S, (ended, out_a)
    assert "rank 1" in out_a and "heartbeat" in out_a, out_a
    assert codes[0] not in (None, 0), (codes, out_a)
    assert alive(_pids_in(a.namespace)) == [], [cmdline(p) for p in alive(_pids_in(a.namespace))]

    # node B loses rank 0 and the store with it. Its heartbeat ends the worker (after twice the bound: the store
    # calls block in recv() over a link that vanished without a reset, whatever the store's timeout says),
    # naming the store's address. torchrun's agent on B polls the store from its main loop (num_nodes_waiting ->
    # TCPStore.get) and would stay blocked there, deaf to SIGTERM, even with --rdzv-conf read_timeout=10: the
    # worker ends it as it goes. Should either regress, the test says which (xfail), not a bare timeout.
    gaps = []
    if ended.get("b", float("inf")) > DETECTION_BOUND_S:
        gaps.append(f"B's worker still ran {DETECTION_BOUND_S:g} s after the cut")
    elif "rank 0" not in out_b and a.address not in out_b:
        gaps.append(f"B's worker ended without naming rank 0 or {a.address}: {out_b[-500:]}")
    if codes[1] in (None, 0):
        gaps.append(f"B's torchrun {'still ran' if codes[1] is None else 'exited 0'} {EXIT_BOUND_S:g} s after the cut")
    if gaps:
        pytest.xfail("; ".join(gaps))
    assert alive(_pids_in(b.namespace)) == [], [cmdline(p) for p in alive(_pids_in(b.namespace))]
