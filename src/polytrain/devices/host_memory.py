"""CPU memory for tensors: ``--host-memory cache`` keeps freed blocks for reuse, like PyTorch's CUDA allocator.

PyTorch allocates CPU tensors with the C library's malloc. glibc gives large freed blocks back to the
operating system (``munmap``, and trimming the top of its heap). A training step allocates the same
activations and gradients every time, so when they go back it pays for fresh pages every time: the kernel
zeroes each 4 KiB page on first touch, one page fault at a time. glibc's threshold slides up after a large
block is freed, so whether a run keeps faulting depends on what the process freed before, and varies from
run to run. Measured on a 2-vCPU VM (CIFAR CNN, batch 64, 1 thread): about 5,000 page faults per step and
10-20% slower steps when it does, none with ``cache``. docs/devices.md has the numbers.

``cache`` sets glibc's mmap threshold to 32 MiB (the most its own sliding threshold ever reaches) and
turns off trimming. After the first steps, the same memory is reused without faults, and the process
keeps its peak memory, as the CUDA caching allocator does. Blocks over 32 MiB still come from the system
each time: at that size the compute per byte hides the cost. ``release`` keeps glibc's defaults.

This is process-wide C library state. It is applied once per worker process by the launcher, and only
where it can be: glibc, and no other malloc preloaded (jemalloc and tcmalloc are tuned by their own
environment variables).
"""

from __future__ import annotations

import ctypes
import os

HOST_MEMORY_CHOICES = ("cache", "release")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
_MMAP_THRESHOLD = 32 << 20
_NO_TRIM = 2**31 - 1  # mallopt takes a C int: trim only when 2 GiB lie unused at the top of the heap
_OTHER_MALLOCS = ("jemalloc", "tcmalloc", "mimalloc")

_state = {"applied": "release", "why": "glibc's default", "large": ""}  # this process's malloc, as set_host_memory left it


def set_host_memory(mode: str) -> str:
    """Make this process's malloc ``cache`` or ``release`` freed memory; return what took effect, in words."""
    if mode not in HOST_MEMORY_CHOICES:
        raise ValueError(f"host memory mode must be one of {', '.join(HOST_MEMORY_CHOICES)}, got {mode!r}")
    if mode == "release":
        return describe_host_memory()  # glibc cannot go back to its sliding threshold; nothing to undo here
    blocker = _why_not_glibc()
    if blocker:
        _state.update(applied="release", why=blocker)
    elif _mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and _mallopt(_M_TRIM_THRESHOLD, _NO_TRIM):
        _state.update(applied="cache", why="")
    else:
        _state.update(applied="release", why="glibc refused the settings")
    return describe_host_memory()


def return_large_blocks(threshold: int, why: str) -> bool:
    """Map every block of ``threshold`` bytes or more on its own and unmap it when freed, whatever
    ``set_host_memory`` chose (smaller blocks stay as it left them); False where malloc is not glibc's. For good
    in this process: glibc cannot go back to its sliding threshold."""
    if _why_not_glibc() or not _mallopt(_M_MMAP_THRESHOLD, threshold):
        return False
    _state.update(large=f"blocks of {threshold >> 20} MiB or more returned to the system when freed ({why})")
    return True


def trim_free_heap() -> bool:
    """Give the pages of the C library's free heap memory back to the kernel (glibc's ``malloc_trim(0)``: free
    memory anywhere in its heaps, not only at the top), so that what is allocated next shows in the resident
    set as it is touched; False where malloc is not glibc's. The memory stays the heap's, to be reused."""
    if _why_not_glibc():
        return False
    trim = ctypes.CDLL(None).malloc_trim
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def describe_host_memory() -> str:
    large = f"; {_state['large']}" if _state.get("large") else ""
    return _describe() + large


def _describe() -> str:
    if _state["applied"] == "cache":
        return "freed tensor memory kept for reuse (--host-memory cache)"
    return f"freed tensor memory returned to the system ({_state['why']})"


def _why_not_glibc() -> str:
    preload = os.environ.get("LD_PRELOAD", "")
    other = next((name for name in _OTHER_MALLOCS if name in preload), None)
    if other:
        return f"{other} is preloaded and has its own settings"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "mallopt") or not hasattr(libc, "gnu_get_libc_version"):
        return "not glibc: no mallopt to tune"
    return ""


def _mallopt(param: int, value: int) -> bool:
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(param, value) == 1
