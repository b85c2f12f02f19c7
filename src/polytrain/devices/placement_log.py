"""The placement log: PyTorch's counterpart of TensorFlow's ``log_device_placement=True``.

Two views, both per rank, printed to the console and written to the log directory:

* :func:`module_table`: module path -> device, parameter count and bytes;
* :class:`OpDeviceLog`: every aten operator that runs while it is active, with the device(s) of its
  tensors and whether it ran in the forward or the backward pass. It is a ``TorchDispatchMode``, so it
  sees the operators below autograd, exactly as the kernels are called. It is bounded (``max_ops``) and,
  through :class:`PlacementLogger`, active on the first training step only by default.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.devices.discovery import format_bytes
from polytrain.devices.spec import LOGGER_NAME

# profiler bookkeeping ops appear around optimizer steps and say nothing about placement
_SKIPPED_NAMESPACES = ("profiler",)


def module_table(model: nn.Module) -> str:
    """An aligned table: every module path, its type, device(s), parameter count and bytes.

    Counts include the module's children, so the first row (the model) holds the totals. Bytes cover
    parameters and buffers; a tensor shared by two children is counted once.
    """
    rows = [("MODULE", "TYPE", "DEVICE", "PARAMS", "BYTES")]
    for name, module in model.named_modules():
        params = {id(p): p for p in module.parameters()}
        buffers = {id(b): b for b in module.buffers() if id(b) not in params}
        tensors = [*params.values(), *buffers.values()]
        devices = sorted({str(t.device) for t in tensors})
        rows.append((
            name or "(model)",
            type(module).__name__,
            ",".join(devices) or "-",
            f"{sum(p.numel() for p in params.values()):,}",
            format_bytes(sum(t.numel() * t.element_size() for t in tensors)),
        ))
    return _align(rows, right=(3, 4))


def _align(rows: list[tuple[str, ...]], right: Iterable[int] = ()) -> str:
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    right = set(right)
    return "\n".join(
        "  ".join(cell.rjust(w) if c in right else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        .rstrip() for row in rows)


@dataclass(frozen=True)
class OpRecord:
    """One operator call: its number in the step, name, phase and the devices of its tensors."""

    index: int
    op: str
    phase: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    note: str = ""

    @property
    def device(self) -> str:
        """Where it ran: the output device, or the inputs' where it returns no tensor."""
        return ",".join(self.outputs or self.inputs) or "-"

    def where(self) -> str:
        """``cpu``, or ``cpu -> cuda:1`` for an operator whose output is on another device than its inputs."""
        if self.inputs and self.outputs and self.inputs != self.outputs:
            return f"{','.join(self.inputs)} -> {','.join(self.outputs)}"
        return self.device


class OpDeviceLog(TorchDispatchMode):
    """Record every operator that runs inside ``with OpDeviceLog() as log:``, with its devices.

    At most ``max_ops`` calls are kept; later ones are only counted (``dropped``). Calls made while
    autograd runs a backward node are tagged ``backward`` (with the node, e.g. ``AddmmBackward0``); the
    others take the current :meth:`phase` label, ``forward`` unless the caller says otherwise (e.g.
    ``with log.phase("optimizer"): opt.step()``). An operator that raises is recorded with a note
    (``not implemented`` for a missing kernel, else ``failed: ErrorType``) before the error goes on.
    """

    def __init__(self, max_ops: int = 1000):
        super().__init__()
        if max_ops < 0:
            raise ValueError(f"max_ops must be >= 0, got {max_ops}")
        self.max_ops = max_ops
        self.records: list[OpRecord] = []
        self.dropped = 0
        self._calls = 0
        self._phase = "forward"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Label the operators run inside the block (backward ones keep their own label)."""
        saved, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = saved

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace in _SKIPPED_NAMESPACES:
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as exc:  # the failing call is the one most worth seeing
            note = "not implemented" if isinstance(exc, NotImplementedError) else f"failed: {type(exc).__name__}"
            self._record(func, (args, kwargs), None, note)
            raise
        self._record(func, (args, kwargs), out, "")
        return out

    def _record(self, func: Any, inputs: Any, out: Any, note: str) -> None:
        self._calls += 1
        if len(self.records) >= self.max_ops:
            self.dropped += 1
            return
        self.records.append(OpRecord(self._calls, str(func), _current_phase(self._phase),
                                     _devices(inputs), _devices(out), note))

    def op_names(self) -> set[str]:
        return {r.op for r in self.records}

    def summary(self) -> list[tuple[str, str, str, int]]:
        """``(op, phase, device, calls)`` rows, in first-seen order."""
        counts = Counter((r.op, r.phase.split(" ")[0], r.where()) for r in self.records)
        return [(op, phase, where, n) for (op, phase, where), n in counts.items()]

    def format(self, *, title: str = "operators and their devices") -> str:
        """The recorded calls one per line, then a per-operator summary."""
        shown = f"{len(self.records)} operator calls"
        if self.dropped:
            shown += f", {self.dropped} more not recorded (max_ops={self.max_ops})"
        rows = [("#", "PHASE", "OPERATOR", "DEVICE", "NOTE")] + [
            (str(r.index), r.phase, r.op, r.where(), r.note) for r in self.records]
        summary = [("OPERATOR", "PHASE", "DEVICE", "CALLS")] + [
            (op, phase, where, str(n)) for op, phase, where, n in self.summary()]
        return (f"{title} ({shown})\n{_align(rows, right=(0,))}\n\nsummary\n{_align(summary, right=(3,))}")

    def write(self, path: str | os.PathLike[str], *, title: str = "operators and their devices") -> Path:
        """Write :meth:`format` to ``path`` (parent folders are created); return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.format(title=title) + "\n", encoding="utf-8")
        return path


def _current_phase(default: str) -> str:
    try:
        node = torch._C._current_autograd_node()
    except AttributeError:  # a private hook; without it every call keeps the caller's label
        return default
    return default if node is None else f"backward ({node.name()})"


def _devices(obj: Any) -> tuple[str, ...]:
    """The distinct devices of the tensors in ``obj`` (through tuples, lists and dicts), in order."""
    found: dict[str, None] = {}
    _collect_devices(obj, found)
    return tuple(found)


def _collect_devices(obj: Any, found: dict[str, None]) -> None:
    if isinstance(obj, torch.Tensor):
        found.setdefault(str(obj.device))
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _collect_devices(item, found)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect_devices(item, found)


class PlacementLogger:
    """What ``--log-placement`` does in one worker: the module table, and the per-op log of chosen steps.

    Output goes to ``logger`` (the console) and, when ``log_dir`` is set, to
    ``placement-rank{R}.txt`` and ``placement-ops-rank{R}-step{S}.txt`` there.
    """

    def __init__(self, *, rank: int = 0, log_dir: str | os.PathLike[str] | None = None,
                 logger: logging.Logger | None = None, steps: Iterable[int] = (0,), max_ops: int = 1000):
        self.rank = rank
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self.steps = frozenset(steps)
        self.max_ops = max_ops
        self.last: OpDeviceLog | None = None
        self.active: OpDeviceLog | None = None  # the log of the step being recorded, if any

    def log_model(self, model: nn.Module) -> str:
        """Print and save the module table; return it."""
        title = f"placement of {type(model).__name__} (rank {self.rank})"
        text = f"{title}\n{module_table(model)}"
        self.logger.info("%s", text)
        if self.log_dir is not None:
            path = self.log_dir / f"placement-rank{self.rank}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text + "\n", encoding="utf-8")
        return text

    def step_context(self, step: int) -> contextlib.AbstractContextManager[OpDeviceLog | None]:
        """Wrap one training step: records its operators if ``step`` is one of ``steps``, else does nothing."""
        if step not in self.steps:
            return contextlib.nullcontext()
        return self._record_step(step)

    @contextlib.contextmanager
    def _record_step(self, step: int) -> Iterator[OpDeviceLog]:
        oplog = OpDeviceLog(self.max_ops)
        self.last = self.active = oplog
        try:
            with oplog:
                yield oplog
        finally:  # a failing step's log is the one most worth reading
            self.active = None
            title = f"operators of step {step} and their devices (rank {self.rank})"
            self.logger.info("%s", oplog.format(title=title))
            if self.log_dir is not None:
                oplog.write(self.log_dir / f"placement-ops-rank{self.rank}-step{step}.txt", title=title)


def log_placement(model: nn.Module, rank: int = 0, log_dir: str | os.PathLike[str] | None = None,
                  logger: logging.Logger | None = None) -> str:
    """Print the module table of ``model`` and save it under ``log_dir``; return the table."""
    return PlacementLogger(rank=rank, log_dir=log_dir, logger=logger).log_model(model)
