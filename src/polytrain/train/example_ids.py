"""``--log-example-ids FILE``: which examples each optimizer step trained on, for auditing exactly-once data.

Every trainer rank notes the dataset indices of the slice it drew for each step (:attr:`Batch.indices`,
taken on the same path that gives it its inputs); at every log point the trainers' notes are gathered and
rank 0 appends one JSON line per step: ``{"step": 5, "epoch": 0, "ids": [...]}``, the global batch as the
slices hold it (data-parallel slices in order; the ranks of one pipeline draw the same slice and count
once). ``step`` counts like the metrics file (the step after which ``step`` steps are done). A resumed run
appends; steps redone after a crash appear again, and the later line is the one the model trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from polytrain.data.batches import Batch, BatchPlan, Slice
from polytrain.distributed.topology import Topology


class ExampleIds:
    """Collects this rank's slices and, collectively over the trainers, writes them (see the module)."""

    def __init__(self, path: str, trainers: Topology, slice_index: int, plan: BatchPlan):
        self.path, self.trainers, self.slice_index, self.plan = Path(path), trainers, slice_index, plan
        self.pending: list[tuple[int, list[int]]] = []
        self.epochs: dict[int, int] = {}  # a stream's epoch of each step noted (a plan cannot tell it)

    def observe(self, batch: Batch) -> None:
        assert batch.indices is not None, "batches drawn by SlicedBatches carry their indices"
        self.pending.append((batch.step, batch.indices.tolist()))
        if batch.epoch is not None:
            self.epochs[batch.step] = batch.epoch

    def flush(self) -> None:
        """Write the steps noted since the last call; a collective over the trainer ranks."""
        noted = self.trainers.all_gather_object((self.slice_index, self.pending, self.epochs))
        self.pending, self.epochs = [], {}
        if not self.trainers.is_main:
            return
        epochs: dict[int, int] = {}  # a stream's: the earliest of any rank's lanes
        for _, _, theirs in noted:
            for step, epoch in theirs.items():
                epochs[step] = min(epoch, epochs.get(step, epoch))
        lines = [json.dumps({"step": step + 1, "epoch": epochs[step] if step in epochs else self.plan.position(step)[0],
                             "ids": ids})
                 for step, ids in merge([(index, steps) for index, steps, _ in noted])]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:
            fh.writelines(line + "\n" for line in lines)


class _Off:
    def observe(self, batch: Batch) -> None:
        pass

    def flush(self) -> None:
        pass


def example_ids(session: Any, trainers: Topology) -> ExampleIds | _Off:
    """The log for ``--log-example-ids`` of a :class:`~polytrain.train.session.Session` (one that does nothing
    when it is not set). A rank's slice index is that of the shard it draws: a strategy whose ranks all draw
    whole global batches and share the work out themselves (async's tickets) draws ``Slice(0, 1)`` on each."""
    path = session.config.data.log_example_ids
    if not path:
        return _Off()
    drawn = session.step_slices
    index = drawn.index if isinstance(drawn, Slice) else session.slice.index
    return ExampleIds(path, trainers, index, session.plan)


def merge(noted: list[tuple[int, list[tuple[int, list[int]]]]]) -> list[tuple[int, list[int]]]:
    """Each step's global batch from every rank's (slice index, [(step, ids)]): the slices in index order.
    Ranks with the same slice index (the stages of one pipeline) must have drawn the same examples."""
    by_step: dict[int, dict[int, list[int]]] = {}
    for index, steps in noted:
        for step, ids in steps:
            seen = by_step.setdefault(step, {}).setdefault(index, ids)
            if seen != ids:
                raise RuntimeError(f"step {step + 1}: two ranks with data slice {index} drew different examples")
    return [(step, [i for index in sorted(slices) for i in slices[index]]) for step, slices in sorted(by_step.items())]


def read(path: str | Path) -> dict[int, Any]:
    """The file's records by step, the last line of each step winning (a resumed run's)."""
    records: dict[int, Any] = {}
    with open(path) as fh:
        for line in fh:
            record = json.loads(line)
            records[record["step"]] = record
    return records
