"""Sleep until a 32-bit word in shared memory changes, and wake its sleepers: Linux's futex, for shm.py.

A rank that waits for a slower peer in the shared-memory all-reduce would otherwise poll: every wake-up
costs CPU that the same worker's backward pass (or the peer itself, on a machine with one core per worker)
needs. With a futex the waiter uses no CPU until the peer's counter moves, and wakes at once when it does.
The kernel compares the word with the expected value before sleeping, so a change between the caller's
read and the sleep is never missed.

Only x86-64 Linux (the only place shm.py runs); ``available()`` says whether this process can use it.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX_X86_64 = 202
_FUTEX_WAIT = 0  # not the _PRIVATE variants: the word is shared between processes
_FUTEX_WAKE = 1
_WAKE_ALL = 2**31 - 1


def is_x86_64_linux(system: str, machine: str) -> bool:
    """Whether ``platform.system()``, ``platform.machine()`` name the one platform shm.py and this run on."""
    return system == "Linux" and machine.lower() in ("x86_64", "amd64")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall():
    if not is_x86_64_linux(platform.system(), platform.machine()):
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                        ctypes.c_void_p, ctypes.c_uint32]
    return syscall


_syscall = _load_syscall()


def available() -> bool:
    return _syscall is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at ``address`` equals ``expected``, at most ``timeout_s``.

    Returns early on a wake-up, a signal, a changed word or the timeout alike: the caller re-reads and
    decides, as with any condition wait.
    """
    timeout_s = max(timeout_s, 0.0)
    whole = int(timeout_s)
    span = _Timespec(whole, int((timeout_s - whole) * 1e9))
    _syscall(_SYS_FUTEX_X86_64, address, _FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.byref(span), None, 0)


def wake(address: int) -> None:
    """Wake every process sleeping on the word at ``address``."""
    _syscall(_SYS_FUTEX_X86_64, address, _FUTEX_WAKE, _WAKE_ALL, None, None, 0)
