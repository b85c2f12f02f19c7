"""All-reduce through shared memory, for worker processes on one machine.

gloo moves every byte through loopback TCP: the kernel copies it into a socket and out again, and gloo's
own threads compete with the workers for the cores. Workers on one machine can instead map the same
memory. Each all-reduce goes through one chunk-sized window at a time, in three phases:

1. every rank copies its chunk into its own input slot; barrier;
2. rank r sums the r-th share of every input slot, in rank order, into the shared output; barrier;
3. every rank copies the whole output back.

Each element is summed by one rank in one fixed order, so all ranks get bitwise the same result, and each
rank reads and writes about three times the tensor's size whatever the number of ranks. Phase 1 of the next
chunk may start while a slower rank still copies out (phase 3): inputs are no longer read by then, and the
output is only written again after everyone has passed the next barrier, so one window suffices.

Barriers are one counter per rank in the mapping, each on its own cache lines. A waiting rank yields the
CPU briefly, then sleeps on the late rank's counter (a futex: no CPU used while waiting, woken as soon as the
counter moves), and after the timeout raises an error naming the ranks that never came.
The file lives in /dev/shm and is unlinked as soon as every rank has mapped it, so a killed job leaves
nothing behind.

Memory order: a rank writes its data, then its counter; a peer reads the counter, then the data. x86-64
keeps stores in program order and loads in program order (TSO), which is all this needs. Weaker machines
(ARM) would need fences that Python cannot issue, so the transport is only offered on x86-64 Linux.
"""

from __future__ import annotations

import os
import platform
import queue
import socket
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from polytrain.distributed import collectives, futex
from polytrain.errors import CommunicationError, ConfigError

SHM_DIR = "/dev/shm"
DEFAULT_CHUNK_BYTES = 8 << 20
_COUNTER_STRIDE = 16  # int64s per counter: 128 bytes, so no two ranks' counters share a cache line pair
_PAGE = 4096
_ALIGN = 64  # share boundaries, in elements, so each rank's share starts vector-aligned
_SPIN_SECONDS = 5e-5  # yield this long before sleeping: most waits are a slower peer finishing a copy
_SLEEP_SECONDS = 5e-5  # polling interval where futexes are unavailable


@dataclass(frozen=True)
class ShmPlan:
    """Whether gradients go through shared memory, and why not if they do not. Pure data: printable, testable."""

    use: bool
    reason: str  # why not, when ``use`` is False
    chunk_bytes: int = 0

    def describe(self) -> str:
        return "shared memory" if self.use else f"the process group's all-reduce ({self.reason})"


def header_bytes(world_size: int) -> int:
    """Bytes of the counters, rounded up to whole pages (one page up to 32 ranks)."""
    return round_up(world_size * _COUNTER_STRIDE * 8, _PAGE)


def region_bytes(world_size: int, chunk_bytes: int) -> int:
    """Bytes of the mapping: counters, one input slot per rank, one output."""
    return header_bytes(world_size) + (world_size + 1) * chunk_bytes


def plan_shm(*, device_type: str, machine: str, system: str, machine_ids: list[str], largest_bytes: int,
             free_bytes: int | None, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ShmPlan:
    """Decide from facts gathered on every rank; every rank gets the same facts, so the same answer."""
    world = len(machine_ids)
    if world < 2:
        return ShmPlan(False, "one process: nothing to exchange")
    if device_type != "cpu":
        return ShmPlan(False, f"workers run on {device_type}; shared memory is for CPU workers")
    refused = refusal(machine=machine, system=system, machine_ids=machine_ids, free_bytes=free_bytes,
                      ranks=f"{world} workers")
    if refused:
        return ShmPlan(False, refused)
    chunk = round_up(max(min(chunk_bytes, largest_bytes), 4096), 4096)
    while chunk > (256 << 10) and region_bytes(world, chunk) > free_bytes // 2:
        chunk //= 2  # a small /dev/shm (containers default to 64 MB) still works, in more rounds
    need = region_bytes(world, chunk)
    if need > free_bytes // 2:
        return ShmPlan(False, f"{SHM_DIR} has {free_bytes >> 20} MiB free and {world} workers need "
                              f"{need >> 20} MiB; enlarge it (docker run --shm-size=1g)")
    return ShmPlan(True, "", chunk)


def refusal(*, machine: str, system: str, machine_ids: list[str] | tuple[str, ...], free_bytes: int | None,
            ranks: str) -> str | None:
    """Why ``ranks`` (their machines' ids and the least /dev/shm free of them) cannot share memory, or None."""
    if not futex.is_x86_64_linux(system, machine):
        return f"shared memory needs x86-64 Linux; this is {machine} {system}"
    if len(set(machine_ids)) > 1:
        return f"the {ranks} run on {len(set(machine_ids))} machines"
    if free_bytes is None:
        return f"{SHM_DIR} is not available"
    return None


def machine_id() -> str:
    """Equal for two processes exactly when they run on the same machine since the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def gather_facts(topology: Any) -> dict[str, Any]:
    """What decides whether the ranks can share memory, the same on every rank (a collective): this machine's
    platform, every rank's machine id and the least /dev/shm free of them (None: one has none)."""
    facts = topology.all_gather_object((machine_id(), shm_free_bytes()))
    frees = [free for _, free in facts]
    return dict(machine=platform.machine(), system=platform.system(), machine_ids=[mid for mid, _ in facts],
                free_bytes=None if None in frees else min(frees))


def gather_plan(topology: Any, largest_bytes: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> ShmPlan:
    """Every rank states its machine; all ranks then decide alike (a collective: call it on every rank)."""
    return plan_shm(device_type=topology.device.type, largest_bytes=largest_bytes, chunk_bytes=chunk_bytes,
                    **gather_facts(topology))


def map_shared(topology: Any, size: int, name: str, failed: str, fix: str,
               extra: Any = None) -> tuple[torch.Tensor, str, list[Any]]:
    """A file of ``size`` bytes in /dev/shm, made by rank 0 and mapped by every rank, then unlinked (a collective
    over ``topology``): the mapping, the file's path and every rank's ``extra``. A rank that cannot make or map it
    is one ConfigError line on every rank: ``failed``, what went wrong, then ``fix``."""
    path: str | None = None
    if topology.rank == 0:
        try:
            fd, path = tempfile.mkstemp(prefix=f"polytrain-{name}-", dir=SHM_DIR)
            os.ftruncate(fd, size)
            os.close(fd)
        except OSError as exc:  # told to the others through the broadcast, so nobody waits for it
            path = f"!rank 0 cannot create a {size >> 20} MiB file in {SHM_DIR}: {exc.strerror}"
    path = topology.broadcast_object(path)
    if path.startswith("!"):
        raise ConfigError(f"{failed}: {path[1:]}; {fix}")
    try:
        mapping, problem = torch.from_file(path, shared=True, size=size, dtype=torch.uint8), None
    except (OSError, RuntimeError) as exc:
        mapping, problem = None, f"rank {topology.rank} cannot map {path}: {exc}"
    facts = topology.all_gather_object((problem, extra))  # everyone has mapped or failed
    if topology.rank == 0:
        os.unlink(path)
    problems = [p for p, _ in facts if p]
    if problems:
        raise ConfigError(f"{failed}: {problems[0]}; {fix}")
    return mapping, path, [e for _, e in facts]


class SharedMemoryAllReduce:
    """In-place sum or average of CPU tensors over the ranks of one machine.

    Every rank must make the same calls in the same order. Use either the direct calls (``sum_``,
    ``average_``) or the background ones (``start_average``) on one object, not both at once: the background
    thread and the caller would race for the same window.
    """

    def __init__(self, mapping: torch.Tensor, rank: int, world_size: int, chunk_bytes: int, timeout_s: float):
        self.rank, self.world_size, self.chunk_bytes, self.timeout_s = rank, world_size, chunk_bytes, timeout_s
        header = header_bytes(world_size)
        counters = mapping[:header].view(torch.int64)
        self._arrived = counters[: world_size * _COUNTER_STRIDE].view(world_size, _COUNTER_STRIDE)[:, 0]
        slots = mapping[header:region_bytes(world_size, chunk_bytes)]
        self._inputs = slots[: world_size * chunk_bytes].view(world_size, chunk_bytes)
        self._output = slots[world_size * chunk_bytes:]
        self._barriers = 0
        # the low 32 bits of each counter (little-endian) are the word a waiter sleeps on
        self._counter_addresses = [self._arrived[r].data_ptr() for r in range(world_size)]
        self._use_futex = futex.available()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self.path = ""  # the file it was mapped from, unlinked once every rank had mapped it
        self._mapping = mapping  # keeps the pages mapped

    @classmethod
    def open(cls, topology: Any, chunk_bytes: int) -> "SharedMemoryAllReduce":
        """Create (rank 0) and map (every rank) the region; a collective."""
        mapping, path, _ = map_shared(topology, region_bytes(topology.world_size, chunk_bytes), "allreduce",
                                      "shared-memory gradient exchange failed", "pass --comm backend")
        exchange = cls(mapping, topology.rank, topology.world_size, chunk_bytes, topology.timeout.total_seconds())
        exchange.path = path
        return exchange

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, average=False)

    def average_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(tensor, average=True)

    def start_average(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Average ``tensor`` in place on this object's own thread; the future completes with it.

        The caller keeps computing meanwhile (DDP: the rest of backward), and waits only when it needs the
        result. Calls are served in the order they were made, which must be the same on every rank.
        """
        return self._start(tensor, average=True)

    def start_sum(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Like :meth:`start_average`, summing: served in the same queue, after what was started before."""
        return self._start(tensor, average=False)

    def _start(self, tensor: torch.Tensor, average: bool) -> torch.futures.Future:
        done: torch.futures.Future = torch.futures.Future()
        if self._thread is None:
            # the thread holds only a weak reference, and stops when this object is collected
            self._thread = threading.Thread(target=_serve, args=(self._queue, weakref.ref(self)),
                                            name="polytrain-shm-allreduce", daemon=True)
            self._thread.start()
            weakref.finalize(self, self._queue.put, None)
        self._queue.put((tensor, average, done))
        return done

    def _serve_one(self, tensor: torch.Tensor, average: bool, done: torch.futures.Future) -> None:
        if self._failure is not None:  # the ranks are out of step for good: fail the rest at once
            done.set_exception(self._failure)
            return
        try:
            done.set_result(self._all_reduce(tensor, average=average))
        except BaseException as exc:  # handed to whoever waits on the future
            self._failure = exc
            done.set_exception(exc)

    def _all_reduce(self, tensor: torch.Tensor, average: bool) -> torch.Tensor:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"shared-memory all-reduce takes contiguous CPU tensors, got a "
                             f"{'contiguous' if tensor.is_contiguous() else 'strided'} tensor on {tensor.device}")
        record = collectives.begin("shm:all_reduce", "shm", [list(tensor.shape)])  # for a hang report
        flat = tensor.view(-1)
        per_chunk = self.chunk_bytes // flat.element_size()
        inputs, output = self._inputs.view(flat.dtype), self._output.view(flat.dtype)
        for start in range(0, flat.numel(), per_chunk):
            part = flat[start:start + per_chunk]
            count = part.numel()
            inputs[self.rank, :count].copy_(part)
            self._barrier()
            lo, hi = self._share(count)
            if hi > lo:
                out = output[lo:hi]
                torch.add(inputs[0, lo:hi], inputs[1, lo:hi], out=out)
                for r in range(2, self.world_size):
                    out.add_(inputs[r, lo:hi])
                if average:
                    out.div_(self.world_size)
            self._barrier()
            part.copy_(output[:count])
        collectives.end(record)
        return tensor

    def _share(self, count: int) -> tuple[int, int]:
        step = round_up(-(-count // self.world_size), _ALIGN)
        lo = min(self.rank * step, count)
        return lo, min(lo + step, count)

    def _barrier(self) -> None:
        self._barriers += 1
        target = self._barriers
        self._arrived[self.rank] = target
        if self._use_futex:
            futex.wake(self._counter_addresses[self.rank])
        start = None
        while True:
            counts = self._arrived.tolist()
            late = [r for r, n in enumerate(counts) if n < target]
            if not late:
                return
            now = time.monotonic()
            start = now if start is None else start
            if now - start > self.timeout_s:
                raise CommunicationError(
                    f"rank {self.rank}: rank(s) {', '.join(map(str, late))} did not reach shared-memory "
                    f"all-reduce barrier {target} within {self.timeout_s:g} s (raise --timeout if a step "
                    "really takes this long)")
            if now - start < _SPIN_SECONDS:
                os.sched_yield()
            elif self._use_futex:
                futex.wait(self._counter_addresses[late[0]], counts[late[0]], start + self.timeout_s - now)
            else:
                time.sleep(_SLEEP_SECONDS)


def _serve(requests: queue.SimpleQueue, exchange_ref: "weakref.ref[SharedMemoryAllReduce]") -> None:
    while (item := requests.get()) is not None:
        exchange = exchange_ref()
        if exchange is None:
            return
        exchange._serve_one(*item)
        del exchange, item  # hold no reference while idle


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
