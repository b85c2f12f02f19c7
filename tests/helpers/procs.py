"""Reading a job's processes and listening sockets from /proc (Linux)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo += children.get(current, [])
    return out


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except OSError:
            pass
    return out


def _socket_inodes(pids: list[int]) -> set[str]:
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _decode(hex_addr: str) -> str:
    host, _ = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    words = struct.unpack("<4I", raw)  # each 32-bit word is little-endian in /proc/net/tcp6
    return str(ipaddress.IPv6Address(b"".join(struct.pack(">I", w) for w in words)))


def listening_addresses(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state owned by ``pids``."""
    inodes = _socket_inodes(pids)
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    out.append((_decode(fields[1]), int(fields[1].split(":")[1], 16)))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as fh:
            return fh.read().replace("\0", " ")
    except OSError:
        return ""


def leftover_children(pid: int) -> list[int]:
    """Live descendants of ``pid``, except multiprocessing's resource tracker (one per parent process,
    it exits with the parent, not with a job)."""
    return [p for p in alive(descendants(pid)) if p != pid and "resource_tracker" not in cmdline(p)]


def spawn_order(pids: list[int]) -> list[int]:
    """``pids`` of processes forked one shortly after another, in the order they were forked.

    Linux hands out pids cyclically, wrapping at pid_max (32768 on some machines: a busy test run wraps
    it), so a later process can have the smaller pid. Between forks moments apart, far fewer than half
    the pid space is used, so "b after a" is "(b - a) mod pid_max < pid_max / 2"."""
    with open("/proc/sys/kernel/pid_max") as fh:
        pid_max = int(fh.read())
    first = next(p for p in pids if all((q - p) % pid_max < pid_max // 2 for q in pids))
    return sorted(pids, key=lambda p: (p - first) % pid_max)
