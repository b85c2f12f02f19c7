"""The parts of a training step, labelled where they run: ``with phase("forward"): ...``.

The trainer and the strategies label their step's parts with :func:`phase`: ``data`` (drawing the batch),
``forward``, ``backward``, ``exchange`` (sending or averaging gradients, parameters or activations with other
ranks), ``wait`` (waiting for another rank with nothing to send) and ``update`` (learning rate, zeroing,
clipping and the optimizer step). A part measured by a strategy inside another one (DDP's exchange of the last
gradient bucket, which backward waits for) is handed over with :func:`interval`.

Outside a profiled step (``--profile STEPS``: :mod:`polytrain.train.profile`) a label costs one global read
and changes nothing; inside one, each label is a ``torch.profiler.record_function`` range named
``polytrain.PHASE`` in the trace and a timed span in :class:`StepPhases`, from which the profile's summary
takes each phase's own time (its span less the labelled spans inside it).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

PHASES = ("data", "forward", "backward", "exchange", "wait", "update")

_active: "StepPhases | None" = None  # the step being profiled in this process, if any
_NOTHING = contextlib.nullcontext()


def phase(name: str) -> contextlib.AbstractContextManager[None]:
    """Label the enclosed part of a step as ``name`` (one of :data:`PHASES`)."""
    recorder = _active
    return _NOTHING if recorder is None else recorder.span(name)


def labelling() -> bool:
    """Whether a step is being profiled here (a label does something): a caller with several labels and nothing
    else to enter may take a path without them when it is not."""
    return _active is not None


def interval(name: str, start: float, end: float) -> None:
    """A part of the enclosing phase, from ``start`` to ``end`` (``time.perf_counter()`` seconds), that is
    ``name`` instead (measured by the caller: e.g. the end of a backward spent waiting for an exchange)."""
    recorder = _active
    if recorder is not None and end > start:
        recorder.spans.append((name, start, end, recorder.depth + 1))
        recorder.moved.append((name, start, end))


class StepPhases:
    """The labelled spans of one step: ``(name, start, end, depth)``, depth 0 the outermost."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float, int]] = []
        self.moved: list[tuple[str, float, float]] = []  # the intervals handed over (not in the trace yet)
        self.depth = -1

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        from torch.profiler import record_function

        with record_function(f"polytrain.{name}"):
            self.depth += 1
            start = time.perf_counter()
            try:
                yield
            finally:
                self.spans.append((name, start, time.perf_counter(), self.depth))
                self.depth -= 1

    def own_seconds(self) -> dict[str, float]:
        """Each phase's own seconds in this step: its spans less the labelled spans directly inside them."""
        out: dict[str, float] = {}
        for name, start, end, depth in self.spans:
            inner = sum(e - s for _, s, e, d in self.spans if d == depth + 1 and s >= start and e <= end)
            out[name] = out.get(name, 0.0) + (end - start) - inner
        return out


@contextlib.contextmanager
def recording(step: StepPhases) -> Iterator[StepPhases]:
    """Record the labels of the enclosed code into ``step`` (one profiled step)."""
    global _active
    saved, _active = _active, step
    try:
        yield step
    finally:
        _active = saved
