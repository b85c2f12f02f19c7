"""``--checkpoint-background``: periodic checkpoints written in a thread; the step waits only for the copy.

At a periodic checkpoint the training thread takes the state with the collectives a checkpoint needs (a
strategy's gather, every rank's RNG states), copies its tensors to host memory, and hands the copy to a writer
thread, which writes the file, its manifest and the ``latest`` pointer exactly as a checkpoint in the foreground
does, while training goes on. One write at a time: a checkpoint that comes while the previous one is still being
written waits for it, and that wait counts in its stall. The run's last checkpoint (at its end, or where a stop
signal stopped it) is written in the foreground, after the write in flight.

A sharded run (``fsdp``: each rank writes its own part) writes the parts in the background too; they are
*committed* (every rank's part checked, renamed into place, the main rank's file and manifest written, ``latest``
moved: a collective) on the training thread at the run's next checkpoint. Until then the previous checkpoint is
the latest, as during any write.

A write the disk refuses does what ``--on-checkpoint-error`` says (stop, or warn and go on), found when the
training thread next settles (the next checkpoint, the end); every trainer rank agrees on it there, so every rank
raises the same error. The copy in host memory counts against ``--memory-limit``. A process that ends on an
error first waits for the write in flight, so no file is left half-written.

The seconds each periodic checkpoint held the training thread (taking the state, copying it, waiting for the
previous write) are the summary's ``checkpoint_stall_s`` (count, median, largest, total), with or without the
option.
"""

from __future__ import annotations

import copy
import queue
import statistics
import threading
from typing import Any, Callable

import torch

from polytrain.errors import CheckpointError


#: values that cannot change in place: a copy shares them (an RNG state's 625 numbers are not copied one by one)
_ATOMS = (int, float, bool, str, bytes, type(None))


def copy_state(state: Any, leaf: Callable[[torch.Tensor], Any] | None = None) -> Any:
    """A copy of ``state`` (nested dicts, lists, tuples) whose tensors are detached copies in host memory: a
    state_dict's tensors are the live ones, which training changes in place. ``leaf(tensor)``, where given, makes
    each tensor's copy instead (``--on-failure continue``: a sharded tensor's own rows, train/heal.py)."""
    if isinstance(state, torch.Tensor):
        return leaf(state) if leaf is not None else state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: copy_state(value, leaf) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        if all(type(value) in _ATOMS for value in state):
            return type(state)(state)
        return type(state)(copy_state(value, leaf) for value in state)
    return state if type(state) in _ATOMS else copy.deepcopy(state)


class CheckpointWrites:
    """This rank's checkpoint writes: at most one in flight, in a thread; the stall of each checkpoint."""

    def __init__(self, background: bool, name: str = "checkpoint", agree: bool = True):
        self.background, self.name = background, name
        self.agree = agree  # False: writes that never fail as a CheckpointError (a snapshot's warn): nothing to agree
        self._writer: threading.Thread | None = None  # started at the first background write, kept for the next
        self._jobs: queue.SimpleQueue[Callable[[], Any] | None] = queue.SimpleQueue()
        self._written = threading.Event()
        self._in_flight = False
        self._result: list[Any] = []  # what the write returned, or the exception it raised
        self._commit: Callable[[Any], Any] | None = None  # a sharded write's commit (collective)
        self.stalls: list[float] = []

    def start(self, write: Callable[[], Any], commit: Callable[[Any], Any] | None = None,
              background: bool = True) -> None:
        """Run ``write()`` in the writer thread (or now, when not ``background``); ``commit(its result)``, if
        given, is what :meth:`settle` calls on the training thread afterwards (every trainer rank together)."""
        assert not self._in_flight and not self._result, "settle() the previous write first"
        self._commit = commit
        if not (self.background and background):
            self._result.append(_call(write))
            return
        if self._writer is None:  # one thread for every write (none started for each: the step waits for none)
            self._writer = threading.Thread(target=self._serve, name="polytrain-checkpoint-write", daemon=True)
            self._writer.start()
        self._written.clear()
        self._in_flight = True
        self._jobs.put(write)

    def _serve(self) -> None:
        while (write := self._jobs.get()) is not None:
            self._result.append(_call(write))
            self._written.set()

    def close(self) -> None:
        """Wait for the write in flight and end the writer thread (the run's end, however it ends)."""
        self.wait()
        if self._writer is not None:
            self._jobs.put(None)
            self._writer.join()
            self._writer = None

    def wait(self) -> None:
        """Wait for the write in flight (nothing else: no collective); before the process ends on an error, so
        that no file is left half-written."""
        if self._in_flight:
            self._written.wait()
            self._in_flight = False

    def settle(self, group: Any) -> Any:
        """Wait for the write in flight and commit it; every trainer rank calls this at the same point
        (collective over ``group`` in the background: a write that failed on any rank raises the same error on
        every rank; in the foreground the rank that failed raises it, as a checkpoint always did).
        Returns what the write (or its commit) returned: a path, or None."""
        self.wait()
        result = self._result[0] if self._result else None
        commit, self._result, self._commit = self._commit, [], None
        failed = str(result) if isinstance(result, CheckpointError) else None
        if self.background and self.agree and group.world_size > 1:  # (foreground: the rank that failed raises it)
            failed = next((f for f in group.all_gather_object(failed) if f is not None), None)
        if failed is not None:
            raise CheckpointError(failed)
        if isinstance(result, BaseException):  # anything but the disk's refusal: a bug, raised where it happened
            raise result
        return commit(result) if commit is not None else result

    def summary(self) -> dict[str, Any]:
        """``checkpoint_stall_s`` (``snapshot_stall_s``: train/snapshot.py) for the run's summary (nothing when no
        periodic checkpoint was written)."""
        if not self.stalls:
            return {}
        return {f"{self.name}_stall_s": {"checkpoints": len(self.stalls),
                                       "median": round(statistics.median(self.stalls), 4),
                                       "max": round(max(self.stalls), 4),
                                       "total": round(sum(self.stalls), 4)}}


def _call(write: Callable[[], Any]) -> Any:
    try:
        return write()
    except BaseException as exc:  # handed to the training thread, which raises it
        return exc
