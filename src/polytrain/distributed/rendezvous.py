"""How worker processes find each other without listening beyond loopback.

PyTorch's TCPStore binds every interface even when told ``127.0.0.1``. The local launcher therefore binds a
socket itself, to ``127.0.0.1`` (or the address the user passes), and hands TCPStore the listening file
descriptor; workers connect to it as clients. Gloo is pinned to the loopback interface with
``GLOO_SOCKET_IFNAME`` so its own listening sockets stay on loopback too.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import socket
import struct
from datetime import timedelta

import torch.distributed as dist

from polytrain.errors import ConfigError


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except (OSError, ValueError):
        return False


def loopback_interface() -> str:
    """The loopback interface's name (``lo`` on Linux, ``lo0`` on macOS)."""
    names = [name for _, name in socket.if_nameindex()]
    for name in names:
        if name == "lo" or name.startswith("lo0"):
            return name
    for name in names:
        if name.startswith("lo"):
            return name
    raise ConfigError(f"no loopback interface found among {', '.join(names)}; set GLOO_SOCKET_IFNAME yourself")


def _interface_address(name: str) -> str | None:
    """IPv4 address of interface ``name`` (Linux SIOCGIFADDR), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(address: str) -> str | None:
    """The local interface whose address routes to ``address`` (so gloo listens there and nowhere else)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(address), 9))  # UDP connect sends nothing; it picks a route
            local = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        if _interface_address(name) == local:
            return name
    return None


def gloo_interface(master_addr: str) -> str | None:
    """The interface gloo should use to reach ``master_addr``: loopback for local runs."""
    return loopback_interface() if is_loopback(master_addr) else interface_towards(master_addr)


def bind_listener(address: str, port: int) -> socket.socket:
    """A listening TCP socket on exactly ``address:port`` (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {address} is already in use; pass another --master-port "
                              "or leave it out to pick a free port") from None
        raise ConfigError(f"cannot listen on {address}:{port}: {exc.strerror}") from None
    return sock


class StoreServer:
    """The rendezvous store, hosted by the launcher process on a socket bound to one address."""

    def __init__(self, timeout: timedelta, address: str = "127.0.0.1", port: int = 0):
        self._sock = bind_listener(address, port)
        self.address = address
        self.port = self._sock.getsockname()[1]
        self.fd = self._sock.fileno()
        self.store: dist.TCPStore | None = dist.TCPStore(address, self.port, None, is_master=True,
                                                         timeout=timeout, wait_for_workers=False,
                                                         master_listen_fd=self._sock.fileno())
        # the store owns the listening socket from here on and closes it when it is destroyed; closing it
        # here as well closed the descriptor twice, and the second close hit whatever file had been given
        # that number meanwhile (seen as "Bad file descriptor" in a later torch.load or socket close)
        self._sock.detach()

    def close(self) -> None:
        self.store = None  # its destructor stops the server and closes the socket, once


def connect_store(address: str, port: int, timeout: timedelta) -> dist.Store:
    return dist.TCPStore(address, port, None, is_master=False, timeout=timeout)
