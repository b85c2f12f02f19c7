"""``--memory-limit SIZE``: the most memory each worker may allocate for training, as a device's memory would cap it.

The CPU analogue of TensorFlow's ``per_process_gpu_memory_fraction``. What is counted:

* **CPU** (Linux): the worker's private writable memory (the kernel's ``VmData``: what ``malloc`` and anonymous
  ``mmap`` hand out, so every tensor, the data the worker loads, Python's objects, and thread stacks created
  after the start), above what the worker already holds when the limit is applied: its *baseline*, the
  interpreter, torch and the process group (a few hundred MiB of ``VmData``; the gigabytes of shared,
  read-only library code every process maps are not data and never counted). The limit is the kernel's
  ``RLIMIT_DATA``, set to baseline + SIZE (Linux >= 4.7 counts private writable mappings against it): an
  allocation past it fails in that worker (``malloc`` returns NULL; PyTorch raises "DefaultCPUAllocator:
  can't allocate memory", Python a ``MemoryError``), never the kernel's OOM killer. Memory the allocator
  keeps for reuse (``--host-memory cache``) counts, as a GPU allocator's cache does; but blocks of 128 KiB or
  more are mapped on their own and returned to the kernel when freed (glibc's mmap threshold set to 128 KiB; it
  stays so in the process), so a large block freed is not held against the limit.
* **GPU**: ``torch.cuda.set_per_process_memory_fraction(SIZE / the device's memory)`` on the worker's device:
  the caching allocator's reserved memory is capped, and an allocation past it raises
  ``torch.OutOfMemoryError`` (host memory is not limited then).

Applied at the start of each spawned worker (:func:`apply_memory_limit`, before its first step and after it
has joined the group), and around the function in a one-process run (:func:`limited`), which is the launching
process itself: its previous limit is restored when the run ends, however it ends. Either way an allocation
that would pass the limit becomes :class:`~polytrain.errors.MemoryLimitError` (:func:`memory_error`): one line
naming the rank, the limit, the allocation and what to try; the launcher then stops the other ranks as for any
worker's error.
"""

from __future__ import annotations

import contextlib
import importlib
import mmap
import re
import resource
import sys
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from polytrain.devices.discovery import format_bytes
from polytrain.devices.host_memory import return_large_blocks
from polytrain.errors import ConfigError, MemoryLimitError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([-+]?(?:\d+(?:\.\d*)?|\.\d+))\s*([a-zA-Z]*)\s*$")
_CPU_BYTES = re.compile(r"you tried to allocate (\d+) bytes")
_GPU_BYTES = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_MMAP_THRESHOLD = 1 << 17  # under a limit, blocks of 128 KiB and more go back to the kernel when freed
_NO_MEMORY = ("can't allocate memory", "std::bad_alloc", "could not create a primitive")
SMALLEST = 1 << 20  # the least --memory-limit: below it a worker fails at its first allocations
# torch imports its compiler lazily, at an optimizer's first zero_grad or step (torch._disable_dynamo): 68 MiB of
# module state and op tables whose native code crashes (SIGSEGV) rather than failing cleanly when an allocation
# is refused under the limit, so every limited process imports it first, into its baseline
_BASELINE_MODULES = ("torch._dynamo",)
_CACHED_STACKS = 5  # glibc caches 40 MiB of ended threads' stacks: five of 8 MiB (the default)
ADVICE = ("try --strategy fsdp, more --workers, --activation-checkpointing full or --precision bf16-mixed "
          "(polytrain plan estimates each rank's memory)")


def parse_size(text: str | int) -> int:
    """``600MiB``, ``2GB``, ``1.5GiB``, ``4096`` (bytes) -> bytes; ValueError saying what is accepted."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 600MiB, 2GB or 1073741824 (bytes; units B, KB, MB, GB, TB "
                         f"and KiB, MiB, GiB, TiB), got '{text}'")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"must be more than 0 bytes, got '{text}'")
    return size


def check_memory_limit(text: str) -> None:
    """A size, and at least :data:`SMALLEST` (less fails at a worker's first allocations, before any step)."""
    if parse_size(text) < SMALLEST:
        raise ValueError(f"'{text}' is less than {format_bytes(SMALLEST)}, less than a worker allocates before its "
                         "first step; give a size such as 600MiB (polytrain plan estimates each rank's memory)")


@dataclass
class Applied:
    """The limit this process runs under: ``text`` as given, ``limit`` bytes above ``baseline`` (CPU: the
    ``VmData`` at the start), ``previous``: the limit to restore (CPU: RLIMIT_DATA; GPU: None)."""

    text: str
    limit: int
    device: torch.device
    rank: int
    prefix: str  # "[rank R] " where no launcher names the rank (a one-process run)
    baseline: int = 0
    previous: tuple[int, int] | None = None
    evaluating: str = ""  # the advice while the run evaluates (see evaluating())


_applied: list[Applied] = []  # this process's, innermost last


def apply_memory_limit(text: str | None, device: torch.device, rank: int, *, prefix: bool = False,
                       preload: Sequence[str] = ()) -> Applied | None:
    """Limit this process to ``text`` (``--memory-limit``) more bytes on ``device``; None without a limit.
    ``prefix``: name the rank in the error (no launcher does it for a one-process run). ``preload``: modules
    imported first, so that they are part of the baseline as torch is (the model's library: transformers'
    modules of a ``--model hf:DIR`` hold 37 MiB of data once imported); one that fails to import is left to
    fail where the run imports it."""
    if not text:
        return None
    for name in (*_BASELINE_MODULES, *preload):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    limit = parse_size(text)
    applied = Applied(str(text), limit, torch.device(device), rank, f"[rank {rank}] " if prefix else "")
    if applied.device.type == "cuda":
        index = applied.device.index if applied.device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), index)
    else:
        _limit_data(applied)
    _applied.append(applied)
    return applied


def restore(applied: Applied | None) -> None:
    """Undo :func:`apply_memory_limit` (a one-process run: the launching process goes on after it)."""
    if applied is None:
        return
    if applied.device.type == "cuda":
        index = applied.device.index if applied.device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    elif applied.previous is not None:
        resource.setrlimit(resource.RLIMIT_DATA, applied.previous)
    if applied in _applied:
        _applied.remove(applied)


def room() -> int | None:
    """The bytes this process may still allocate under its ``--memory-limit`` (None: no limit)."""
    applied = _applied[-1] if _applied else None
    if applied is None:
        return None
    if applied.device.type == "cuda":
        return max(0, applied.limit - int(torch.cuda.memory_allocated(applied.device)))
    return max(0, applied.baseline + applied.limit - vm_data())


@contextlib.contextmanager
def limited(text: str | None, device: torch.device, rank: int = 0,
            preload: Sequence[str] = ()) -> Iterator[Applied | None]:
    """Run the block under ``--memory-limit text`` (the rank named in the error) and restore the previous
    limit after it; an allocation past the limit leaves the block as :class:`MemoryLimitError`."""
    applied = apply_memory_limit(text, device, rank, prefix=True, preload=preload)
    try:
        yield applied
    except BaseException as exc:
        error = memory_error(exc)
        if error is exc:
            raise
        raise error from exc
    finally:
        restore(applied)


def memory_error(exc: BaseException) -> BaseException:
    """``exc`` as :class:`MemoryLimitError` when it is an allocation that failed under this process's limit
    (anywhere in its chain of causes); else ``exc`` itself."""
    if not _applied or isinstance(exc, MemoryLimitError):
        return exc
    applied = _applied[-1]
    found = _allocation(exc)
    if found is None:
        return exc
    what = found or "memory"
    if applied.device.type == "cuda":
        where = f"on {applied.device}"
    else:
        in_use = max(0, vm_data() - applied.baseline)
        where = f"with {format_bytes(in_use)} of it in use" if in_use >= mmap.PAGESIZE else "with none of it in use yet"
    advice = f"in evaluation: {applied.evaluating}" if applied.evaluating else ADVICE
    return MemoryLimitError(f"{applied.prefix}out of memory under --memory-limit {applied.text} per worker: "
                            f"allocating {what} {where} would pass it; {advice}")


@contextlib.contextmanager
def evaluating(batch_size: int) -> Iterator[None]:
    """Evaluation in the block: an allocation past the limit there advises a smaller ``--eval-batch-size``
    (its batches are often far larger than training's)."""
    applied = _applied[-1] if _applied else None
    if applied is None:
        yield
        return
    applied.evaluating = f"give a smaller --eval-batch-size (now {batch_size} per worker)"
    try:
        yield
    except BaseException as exc:  # named here, while the advice is evaluation's
        error = memory_error(exc)
        if error is exc:
            raise
        raise error from exc
    finally:
        applied.evaluating = ""


def _allocation(exc: BaseException) -> str | None:
    """What an out-of-memory error was allocating ("" if it does not say); None for any other error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        cpu = _CPU_BYTES.search(text)
        if cpu:
            return format_bytes(int(cpu.group(1)))
        gpu = _GPU_BYTES.search(text)
        if gpu and isinstance(current, torch.OutOfMemoryError):
            return gpu.group(1)
        # oneDNN reports a kernel it had no memory for as "could not create a primitive"
        if isinstance(current, MemoryError) or any(m in text for m in _NO_MEMORY):
            return "a Python object" if isinstance(current, MemoryError) else ""
        current = current.__cause__ or current.__context__
    return None


# -- the CPU's limit: RLIMIT_DATA above the baseline ----------------------------------------------------

def vm_data() -> int:
    """This process's private writable memory in bytes (``VmData`` of /proc/self/status)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def _cache_thread_stacks(count: int = _CACHED_STACKS) -> None:
    """Start ``count`` threads at once and end them: glibc keeps their stacks (up to 40 MiB) for the next
    threads to reuse, so the threads a run starts later (a process group's, a few) take no new memory. A
    thread that could not get a stack under the limit would end the process (C++ code aborts on it)."""
    ready = threading.Barrier(count + 1)
    threads = [threading.Thread(target=ready.wait, name="polytrain-stack-cache", daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    ready.wait()
    for thread in threads:
        thread.join()


def _warm_kernels() -> None:
    """Run a linear layer's forward and backward and a convolution once, so that oneDNN and the BLAS set up
    their process-wide state (code buffers, thread-local scratch) before the baseline: set up under the
    limit, a failure there stays with the process after the limit is lifted."""
    with torch.enable_grad():
        x = torch.randn(8, 64, requires_grad=True)
        layer = torch.nn.Linear(64, 64)
        torch.nn.functional.layer_norm(layer(x), (64,)).softmax(-1).sum().backward()
        image = torch.randn(1, 3, 8, 8, requires_grad=True)
        torch.nn.functional.conv2d(image, torch.randn(4, 3, 3, 3)).relu().sum().backward()


def _limit_data(applied: Applied) -> None:
    if not sys.platform.startswith("linux"):
        raise ConfigError(f"--memory-limit {applied.text} on the CPU needs Linux (its RLIMIT_DATA counts a "
                          f"process's private memory); on {sys.platform} use it with a GPU (--device cuda)")
    torch.zeros(1 << 20).add_(1).sum()  # start torch's CPU threads now: their stacks belong to the baseline
    _warm_kernels()
    _cache_thread_stacks()
    # glibc keeps freed blocks below its threshold (32 MiB under --host-memory cache) in its heap, where they
    # count: fsdp's unit gathers, freed each step, left a rank's data 2-3x its live tensors
    return_large_blocks(_MMAP_THRESHOLD, "--memory-limit")
    applied.baseline = vm_data()
    applied.previous = resource.getrlimit(resource.RLIMIT_DATA)
    soft, hard = applied.baseline + applied.limit, applied.previous[1]
    if hard != resource.RLIM_INFINITY and soft > hard:
        raise ConfigError(f"--memory-limit {applied.text}: this process may not raise its data limit above "
                          f"{format_bytes(hard)} (ulimit -d), {format_bytes(applied.baseline)} of which it holds "
                          "at the start; give a smaller limit or raise the hard limit")
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    try:  # one mapping past the limit must fail, or the kernel does not enforce it
        probe = mmap.mmap(-1, applied.limit + (16 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return
    probe.close()
    resource.setrlimit(resource.RLIMIT_DATA, applied.previous)
    raise ConfigError(f"--memory-limit {applied.text}: this Linux kernel does not enforce RLIMIT_DATA on private "
                      "memory (it does from 4.7 on, unless booted with ignore_rlimit_data); run without "
                      "--memory-limit, or on such a kernel")
