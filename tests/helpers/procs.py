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


def worker_rank(pid: int) -> int | None:
    """The rank of a polytrain worker process (its name is ``polytrain-rN``), None for any other process."""
    try:
        with open(f"/proc/{pid}/comm") as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return int(name[len("polytrain-r"):]) if name.startswith("polytrain-r") else None


def leftover_children(pid: int) -> list[int]:
    """Live descendants of ``pid``, except multiprocessing's resource tracker and forkserver (one each per
    parent process, they exit with the parent, not with a job)."""
    return [p for p in alive(descendants(pid))
            if p != pid and not any(keep in cmdline(p) for keep in ("resource_tracker", "forkserver"))]


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler of its own for ``signum`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            mask = next((line.split()[1] for line in fh if line.startswith("SigCgt:")), "0")
    except OSError:
        return False
    return bool(int(mask, 16) >> (signum - 1) & 1)
