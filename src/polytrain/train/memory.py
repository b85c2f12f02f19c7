"""Memory measured in a run: each rank's peak, the bytes of its training state, and its activations.

Three numbers per trainer rank, in the run's end record and summary (docs/devices.md, "Memory"):

* **peak**: on a GPU ``torch.cuda.max_memory_allocated`` of the rank's device; on the CPU the process's peak
  resident memory (Linux's ``VmHWM``, which ``ru_maxrss`` reports; elsewhere ``ru_maxrss``). Both are reset
  when the trainer starts, so an in-process run's peak is its own, not the launching program's earlier one.
* **state**: the bytes of the parameters (and buffers), gradients and optimizer state this rank holds,
  counted by storage: a tensor's storage once however many views share it, a sharded tensor's local shard
  (a ``DTensor``'s ``_local_tensor``), a pipeline stage's emptied tensors as the 0 bytes they hold. The
  optimizers are every ``torch.optim.Optimizer`` the strategy holds (diloco's outer one and its anchor too).
* **activations**: the most bytes autograd kept for backward at once during a step (the tensors saved for
  backward, counted by :class:`SavedTensors` through ``torch.autograd.graph.saved_tensors_hooks``; parameters
  and views of them are not activations): the most of the run's 2nd to :data:`MEASURED_STEPS`-th steps (the
  first step's in a run of one step).

``polytrain plan`` estimates the same quantities before a run (:mod:`polytrain.parallel.memory_plan`),
counting activations with the same :class:`SavedTensors` on a forward that allocates nothing.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from polytrain.devices.host_memory import trim_free_heap

#: the steps (from the run's first) whose activations are measured; the first counts only in a run of one step:
#: it also holds what is done once (a pipeline times its units on it). Every step of a run has the same shapes
#: (but a bucketed language-model run's first steps may be shorter than its longest)
MEASURED_STEPS = 4
MIB = float(1 << 20)
_NOTHING = contextlib.nullcontext()


# -- what autograd saves for backward -------------------------------------------------------------------

class SavedTensors:
    """The bytes of the tensors autograd saves for backward while :meth:`hooks` is active: ``current`` (held
    now) and ``peak`` (the most held at once). Each storage counts once, however many saved views share it,
    and until the last of them is released; parameters (and views of them, such as a weight's transpose) are
    state, not activations, and are not counted."""

    def __init__(self, shapes: bool = False) -> None:
        #: count tensors that have shapes only (meta, fake): the memory plan's forward, whose sizes are concrete
        self.shapes = shapes
        self.current = 0
        self.peak = 0
        self.count = 0  # tensors saved
        self._live: dict[Any, list[int]] = {}  # storage key -> [bytes, saved references]
        self._lock = threading.Lock()  # a GPU's backward releases saved tensors on autograd's device threads

    def hooks(self) -> contextlib.AbstractContextManager[None]:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        if _is_parameter(tensor) or (not self.shapes and _holds_nothing(tensor)):
            return tensor
        key, size = _storage(tensor)
        with self._lock:
            self.count += 1
            held = self._live.get(key)
            if held is None:
                self._live[key] = [size, 1]
                self.current += size
                self.peak = max(self.peak, self.current)
            else:
                held[1] += 1
        return _Held(self, key, tensor)

    def _release(self, key: Any) -> None:
        with self._lock:
            held = self._live.get(key)
            if held is None:
                return
            held[1] -= 1
            if held[1] == 0:
                self.current -= held[0]
                del self._live[key]


class _Held:
    """A saved tensor as autograd keeps it; its release (autograd drops it after backward) is counted."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: SavedTensors, key: Any, tensor: torch.Tensor):
        self.counter, self.key, self.tensor = counter, key, tensor

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at interpreter exit)
            self.counter._release(self.key)


def _unpack(packed: Any) -> torch.Tensor:
    return packed.tensor if isinstance(packed, _Held) else packed


def _holds_nothing(tensor: torch.Tensor) -> bool:
    """A tensor with shapes only: on the meta device, or a fake one (a traced pipeline stage infers its
    shapes on fake tensors in its first step; their sizes may be symbolic, which no count can hold)."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


# -- the bytes a rank holds -----------------------------------------------------------------------------

def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's local shard (``DTensor``: FSDP2's parameters, gradients and their optimizer state)."""
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else tensor


def _storage(tensor: torch.Tensor) -> tuple[Any, int]:
    """(a key for ``tensor``'s storage, the storage's bytes)."""
    tensor = _local(tensor)
    try:
        storage = tensor.untyped_storage()
        return ("storage", storage._cdata), storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError):  # a tensor without a plain storage
        return ("tensor", id(tensor)), tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class StateBytes:
    """Bytes of a rank's training state: ``parameters`` (with the model's buffers), ``gradients``,
    ``optimizer`` (every state tensor of every optimizer, and an optimizer's own parameters that are not the
    model's: diloco's anchor)."""

    parameters: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer | None] = (),
                kept: Iterable[torch.Tensor] = ()) -> StateBytes:
    """What ``module`` and ``optimizers`` hold on this rank, each storage counted once (in the first of
    parameters, gradients, optimizer that holds it); ``kept``, tensors a strategy keeps besides (diloco's anchor
    and outer momentum), count as optimizer state."""
    seen: set[Any] = set()

    def add(tensors: Iterable[Any]) -> int:
        total = 0
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            key, size = _storage(tensor)
            if key not in seen:
                seen.add(key)
                total += size
        return total

    params = list(module.parameters())
    parameters = add([*params, *module.buffers()])
    gradients = add(p.grad for p in params)
    unique = list({id(opt): opt for opt in optimizers if opt is not None}.values())
    optimizer = add(t for opt in unique for group in opt.param_groups for t in group["params"])
    optimizer += add(value for opt in unique for per_param in opt.state.values() for value in per_param.values())
    optimizer += add(kept)
    return StateBytes(parameters, gradients, optimizer)


def strategy_state(strategy: Any) -> StateBytes:
    """What a strategy holds on this rank: its model and optimizer, and the copies it keeps besides
    (``traits.copies``: diloco's anchor and outer momentum, from its :meth:`local_state`)."""
    kept = {}
    if strategy.traits.copies:
        kept = {k: v for k, v in strategy.local_state().items() if k not in ("model", "optimizer")}
    return state_bytes(strategy.module, [strategy.optimizer], _tensors(kept))


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        state = list(state.values())
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


# -- the peak -------------------------------------------------------------------------------------------

def peak_measure(device: torch.device) -> str:
    """What :func:`peak_bytes` measures on ``device``, in words."""
    return "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS"


def reset_peak(device: torch.device) -> None:
    """Start the peak over from now (Linux: the resident high-water mark of this process; a GPU: the
    allocator's peak statistics of ``device``)."""
    if device.type == "cuda":
        if torch.cuda.is_initialized():  # before CUDA starts there is no peak, and torch refuses to reset one
            torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as fh:  # "5": reset the peak RSS to the current RSS
            fh.write("5")


def peak_bytes(device: torch.device) -> int:
    """The peak since :func:`reset_peak`: ``torch.cuda.max_memory_allocated`` on a GPU, else this process's
    peak resident set (``VmHWM`` on Linux, ``ru_maxrss`` elsewhere)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    found = _status_bytes("VmHWM")
    if found is not None:
        return found
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == "darwin" else maxrss * 1024)  # bytes on macOS, KiB elsewhere


def current_bytes(device: torch.device) -> int:
    """What :func:`peak_bytes` counts, now: the memory allocated on a GPU, the resident set (``VmRSS``) here."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    found = _status_bytes("VmRSS")
    return found if found is not None else peak_bytes(device)


def _status_bytes(field: str) -> int | None:
    """A size field of this process's ``/proc/self/status`` in bytes (None: not on Linux)."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    return None


@dataclass
class Measured:
    """What :meth:`MemoryMeter.apart` measured: the block's peak above what was in use at its start."""

    need: int = 0


# -- the trainer's meter --------------------------------------------------------------------------------

class MemoryMeter:
    """One trainer rank's memory numbers: the peak from its start, the activations of its first steps
    (:meth:`step` around each), the state at the end (:meth:`summary`)."""

    def __init__(self, device: torch.device | str = "cpu", measured_steps: int = MEASURED_STEPS):
        self.device = torch.device(device)
        self.measured_steps = measured_steps
        self._peaks: list[int] = []  # the measured steps' activations
        self._carried = 0  # the peak before a block measured apart (which starts the peak over)
        reset_peak(self.device)

    @property
    def done(self) -> bool:
        """Whether the measured steps are over (a later step needs no :meth:`step`)."""
        return len(self._peaks) >= self.measured_steps

    @contextlib.contextmanager
    def apart(self) -> Iterator[Measured]:
        """Measure the block's own peak above what is in use at its start (the run's peak so far is kept). On
        the CPU the free heap is given back first (:func:`~polytrain.devices.host_memory.trim_free_heap`): freed
        memory still resident would be reused without growing the resident set, and the block would seem to
        need nothing."""
        self._carried = max(self._carried, peak_bytes(self.device))
        if self.device.type == "cpu":
            trim_free_heap()
        start = current_bytes(self.device)
        reset_peak(self.device)
        measured = Measured()
        try:
            yield measured
        finally:
            measured.need = max(0, peak_bytes(self.device) - start)

    def step(self) -> contextlib.AbstractContextManager[None]:
        """Around one training step: its activations are counted if it is one of the first steps."""
        if self.done:
            return _NOTHING
        return self._measured()

    @contextlib.contextmanager
    def _measured(self) -> Iterator[None]:
        counter = SavedTensors()
        with counter.hooks():
            yield
        self._peaks.append(counter.peak)

    @property
    def activations(self) -> int | None:
        """The most bytes saved for backward at once in a measured step (None: no step taken)."""
        later = self._peaks[1:] or self._peaks
        return max(later) if later else None

    def rank_numbers(self, strategy: Any) -> dict[str, int | None]:
        """This rank's numbers, in bytes."""
        state = strategy_state(strategy)
        return {"peak": max(peak_bytes(self.device), self._carried), **asdict(state), "activations": self.activations}

    def summary(self, strategy: Any, trainers: Any) -> dict[str, Any]:
        """The end summary's memory entries (collective over ``trainers``: every trainer rank calls it)."""
        ranks = trainers.all_gather_object(self.rank_numbers(strategy))
        return {
            "memory_measure": peak_measure(self.device),
            "peak_memory_mb": _mib(max(r["peak"] for r in ranks)),
            "rank_peak_memory_mb": [_mib(r["peak"]) for r in ranks],
            "rank_state_mb": [_mib(r["parameters"] + r["gradients"] + r["optimizer"]) for r in ranks],
            "rank_activation_mb": [_mib(r["activations"]) for r in ranks],
            "rank_memory_bytes": ranks,
        }


def _mib(count: int | None) -> float | None:
    return None if count is None else round(count / MIB, 2)


def memory_line(summary: dict[str, Any]) -> str:
    """The summary's memory, as one line for the command line ("" when the summary has none)."""
    peaks = summary.get("rank_peak_memory_mb")
    if not peaks:
        return ""

    def each(key: str) -> str:
        values = summary.get(key) or []
        return " / ".join("n/a" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.3g}" for v in values)

    return (f"\n  memory per rank: peak {each('rank_peak_memory_mb')} MiB ({summary.get('memory_measure')}); "
            f"parameters+gradients+optimizer {each('rank_state_mb')} MiB; activations "
            f"{each('rank_activation_mb')} MiB")
