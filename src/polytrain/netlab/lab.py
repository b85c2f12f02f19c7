"""N network namespaces on a bridge, each joined to it by a veth pair whose two ends are rate-limited.

Layout of one lab (``prefix`` unique per lab, e.g. ``ptlab-4242-a1b2``)::

    PREFIX-br : bridge br0, one port pN per node (its egress limited: what node N receives)
    PREFIX-n0 : lo, eth0 = 10.213.0.1/24 (its egress limited: what node 0 sends)
    PREFIX-n1 : lo, eth0 = 10.213.0.2/24
    ...

Every veth pair is created directly inside the namespaces (``ip link add eth0 netns A type veth peer name
p0 netns B``), so no interface ever exists in the host's namespace, and deleting the namespaces removes
every link. Each link is full duplex at ``rate`` each way: a token bucket (``tc ... tbf``) on both ends.
The nodes have only loopback and their end of the link: nothing they run can reach beyond the bridge.

Clean-up happens on every path: :meth:`NetLab.down` (the context manager's exit, also on an exception or
Ctrl-C) kills every process still inside the namespaces and deletes them; a watchdog process
(:mod:`polytrain.netlab.reaper`) does the same if the process that made the lab is killed outright; and a
new lab removes what labs of processes that no longer run left behind (:func:`sweep`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Sequence

from polytrain.errors import ConfigError

#: every lab's namespaces are named PREFIX-n<i> / PREFIX-br with PREFIX = NAME_ROOT-<pid of its maker>-<hex>
NAME_ROOT = "ptlab"
_NAME = re.compile(rf"^{NAME_ROOT}-(\d+)-[0-9a-f]+-(?:n\d+|br)$")
#: the nodes' addresses; only ever used inside the lab's own namespaces (each lab has its own bridge)
DEFAULT_SUBNET = "10.213.0.0/24"
INTERFACE = "eth0"  # a node's end of its link, inside its namespace

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12,
          "bps": 8, "kbps": 8 * 10**3, "mbps": 8 * 10**6, "gbps": 8 * 10**9}


def parse_rate(text: str) -> int:
    """A link rate in tc's words (``100mbit``, ``1gbit``, ``500kbit``, ``12.5mbps``) -> bits per second."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text or "")
    if not match or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"--link: '{text}' is not a link rate; write a number and a unit, e.g. 100mbit, "
                          f"1gbit, 500kbit (units: {', '.join(_UNITS)})")
    bits = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if bits < 8_000:
        raise ConfigError(f"--link: '{text}' is below 8kbit, too slow for a rendezvous to finish")
    return int(bits)


def format_rate(bits_per_s: int) -> str:
    """``100000000`` -> ``100mbit`` (tc's notation, the largest unit that divides it)."""
    for unit, size in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits_per_s % size == 0:
            return f"{bits_per_s // size}{unit}"
    return f"{bits_per_s}bit"


def _ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def unavailable() -> str | None:
    """Why a lab cannot be made here (one line), or None. Cheap: creates and deletes one namespace."""
    if not sys.platform.startswith("linux"):
        return "the emulated network needs Linux network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated network needs `{tool}` (iproute2); install it, or leave out --link"
    if os.geteuid() != 0:
        return "the emulated network needs root (network namespaces need CAP_SYS_ADMIN and CAP_NET_ADMIN); " \
               "run as root, or leave out --link"
    probe = f"{NAME_ROOT}-{os.getpid()}-{uuid.uuid4().hex[:6]}-n0"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace here ({made.stderr.strip()}); leave out --link"
    try:
        ran = subprocess.run(["ip", "netns", "exec", probe, "true"], capture_output=True, text=True, timeout=30)
        if ran.returncode != 0:
            return f"cannot run a command in a network namespace here ({ran.stderr.strip()}); leave out --link"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def check_available() -> None:
    """Raise one ConfigError line when a lab cannot be made here."""
    reason = unavailable()
    if reason:
        raise ConfigError(reason)


def lab_namespaces() -> list[str]:
    """Every namespace named like a lab's, made by any process."""
    proc = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]
    return [n for n in names if _NAME.match(n)]


def pids_in(namespace: str) -> list[int]:
    proc = _ip("netns", "pids", namespace, check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def empty(namespace: str, timeout: float = 20.0) -> list[int]:
    """SIGKILL every process in ``namespace`` until none is left; returns those that outlived ``timeout``.
    SIGKILL, because a torchrun agent blocked in a store call does not act on SIGTERM."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in pids_in(namespace) if _running(p)]
        if not pids or time.monotonic() > deadline:
            return pids
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove(namespaces: Sequence[str]) -> list[str]:
    """Kill what runs in ``namespaces`` and delete them (their links go with them); returns those left."""
    for ns in namespaces:
        empty(ns)
    for ns in namespaces:
        _ip("netns", "del", ns, check=False)
    names = set(lab_namespaces())
    return [ns for ns in namespaces if ns in names]


def sweep() -> list[str]:
    """Remove the namespaces of labs whose maker no longer runs (a lab killed with SIGKILL and its watchdog
    with it); returns their names."""
    stale = [ns for ns in lab_namespaces() if not _running(int(_NAME.match(ns).group(1)))]
    remove(stale)
    return stale


@dataclass(frozen=True)
class Node:
    index: int
    namespace: str
    address: str
    interface: str = INTERFACE


class NetLab:
    """``nodes`` namespaces on one bridge, each link limited to ``rate`` (bits/s, or tc's words) each way.

    ``with NetLab(2, "100mbit") as lab:`` then ``lab.popen(0, [...])`` runs a command in node 0's namespace;
    ``lab.tx_bytes(0)`` is what node 0 has sent over its link. ``rate=None``: links without a limit.
    """

    def __init__(self, nodes: int, rate: int | str | None, *, subnet: str = DEFAULT_SUBNET,
                 watchdog: bool = True):
        if nodes < 1:
            raise ConfigError(f"a network lab needs at least 1 node, got {nodes}")
        net = ipaddress.ip_network(subnet)
        if nodes > net.num_addresses - 2:
            raise ConfigError(f"{nodes} nodes do not fit in {subnet}")
        self.rate = parse_rate(rate) if isinstance(rate, str) else rate
        self.prefix = f"{NAME_ROOT}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.bridge = f"{self.prefix}-br"
        self.nodes = [Node(i, f"{self.prefix}-n{i}", str(net.network_address + 1 + i)) for i in range(nodes)]
        self.prefixlen = net.prefixlen
        self._watchdog_on = watchdog
        self._watchdog: subprocess.Popen | None = None
        self._made: list[str] = []

    @property
    def namespaces(self) -> list[str]:
        return [self.bridge] + [n.namespace for n in self.nodes]

    def __enter__(self) -> "NetLab":
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        check_available()
        sweep()
        if self._watchdog_on:  # removes the lab should this process die without running down()
            self._watchdog = subprocess.Popen([sys.executable, "-m", "polytrain.netlab.reaper", self.prefix],
                                              stdin=subprocess.PIPE, start_new_session=True)
        try:
            self._add_namespace(self.bridge)
            _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge, "link", "set", "br0", "up")
            for node in self.nodes:
                self._add_namespace(node.namespace)
                port = f"p{node.index}"
                _ip("link", "add", node.interface, "netns", node.namespace, "type", "veth",
                    "peer", "name", port, "netns", self.bridge)
                _ip("-n", self.bridge, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge, "link", "set", port, "up")
                _ip("-n", node.namespace, "addr", "add", f"{node.address}/{self.prefixlen}", "dev", node.interface)
                _ip("-n", node.namespace, "link", "set", "lo", "up")
                _ip("-n", node.namespace, "link", "set", node.interface, "up")
                if self.rate is not None:
                    self._limit(node.namespace, node.interface)  # what the node sends
                    self._limit(self.bridge, port)  # what it receives
        except BaseException:
            self.down()
            raise

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _limit(self, namespace: str, interface: str) -> None:
        assert self.rate is not None
        rate_bytes = self.rate // 8
        # the bucket holds 10 ms at the rate (at least 64 KiB: a few full-size packets), so the kernel's timer
        # granularity does not cap the rate; at most 50 ms of packets wait in the queue
        burst = max(64 * 1024, rate_bytes // 100)
        subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", interface, "root", "tbf",
                        "rate", f"{self.rate}bit", "burst", str(burst), "latency", "50ms"],
                       check=True, capture_output=True, text=True, timeout=30)

    def down(self) -> None:
        """Kill every process in the lab's namespaces and delete them. Safe to call twice."""
        left = remove(list(reversed(self._made)))
        self._made = []
        if self._watchdog is not None:
            with contextlib.suppress(OSError):
                self._watchdog.stdin.close()  # the watchdog's cue: it checks, finds nothing, and exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._watchdog.wait(timeout=30)
            self._watchdog = None
        if left:
            raise RuntimeError(f"network namespaces left behind: {', '.join(left)} (remove them with "
                               f"`ip netns del NAME`)")

    # -- running things in it ----------------------------------------------------------------------

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run in node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.nodes[node].namespace, *argv]

    def popen(self, node: int, argv: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` in node ``node``'s namespace, in a session of its own (a Ctrl-C to this process's
        terminal does not reach it: :meth:`down` ends it)."""
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen(self.command(node, argv), **kwargs)

    def tx_bytes(self, node: int) -> int:
        """Bytes node ``node`` has sent over its link since the lab was made."""
        n = self.nodes[node]
        proc = _ip("-n", n.namespace, "-s", "-j", "link", "show", "dev", n.interface)
        return int(json.loads(proc.stdout)[0]["stats64"]["tx"]["bytes"])

    def rx_bytes(self, node: int) -> int:
        n = self.nodes[node]
        proc = _ip("-n", n.namespace, "-s", "-j", "link", "show", "dev", n.interface)
        return int(json.loads(proc.stdout)[0]["stats64"]["rx"]["bytes"])


@contextlib.contextmanager
def network_lab(nodes: int, rate: int | str | None, **kwargs) -> Iterator[NetLab]:
    with NetLab(nodes, rate, **kwargs) as lab:
        yield lab
