"""Letting go of a process group that a membership change leaves behind (:mod:`polytrain.distributed.elastic`):
its connections cut, so that an operation blocked in it fails at once, and DTensor's decisions made over its
meshes forgotten."""

from __future__ import annotations

import contextlib
import os
import socket
import sys


def cut_connections(keep_port: int | None) -> int:
    """Shut down this process's established loopback TCP connections (gloo's pairs), all but those to or from
    ``keep_port`` (the rendezvous store's); how many. Linux only (``/proc``); elsewhere nothing is cut."""
    table: dict[str, tuple[int, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            with open(name) as fh:
                for line in fh.read().splitlines()[1:]:
                    f = line.split()
                    local, remote, state, inode = f[1], f[2], f[3], f[9]
                    loopback = remote.startswith("0100007F") or remote.startswith("0000000000000000FFFF00000100007F") \
                        or remote.startswith("00000000000000000000000001000000")
                    if state == "01" and loopback:  # established, to this machine
                        table[inode] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    cut = 0
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{fd}")
                ports = table.get(target[8:-1]) if target.startswith("socket:[") else None
                if ports is None or keep_port in ports:
                    continue
                sock = socket.socket(fileno=int(fd))
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
                finally:
                    sock.detach()
    return cut


def forget_meshes() -> None:
    """Forget DTensor's cached sharding decisions once the groups they were made over are gone. A DeviceMesh equals
    any other of the same shape and axis names whatever its process groups, so a later generation's mesh of the
    shape of an earlier one (2 x 2 again once a replacement joined 1 x 3) would find them, and the tensors they
    make (an optimizer's state made as ``zeros_like`` a parameter) would carry the old mesh, whose groups' names
    no longer resolve, or resolve to other groups."""
    if "torch.distributed.tensor" in sys.modules:  # (none was made otherwise)
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
