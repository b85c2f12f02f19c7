"""The end of a run saves first and evaluates last; an evaluation's batches fit ``--memory-limit``.

A run's last checkpoint and ``--save-model`` are written before its final evaluation, so an evaluation that
fails (out of memory, a bug in a task's metric) loses nothing that was trained, and its error says where the
result is (:func:`saved_first`).

``--eval-batch-size`` is examples per evaluation batch per worker: taken as given; else 256, or, under
``--memory-limit``, as many as fit (:class:`EvalBatchSize`). 256 examples at once may need far more than a
training step (the 62 M-parameter model of docs/fsdp.md trains on 2 examples per worker within 600MiB, and its
evaluation of 256 passes the limit), so before the first evaluation every trainer rank measures two evaluation
batches, of training's micro-batch per worker and of 4 times that: what they needed above what was in use gives
the bytes an example takes and those that do not grow with the batch (an fsdp unit's gathered parameters); the
batch is then as many examples as fit in 80 % of the room left under the limit, at least training's micro-batch
(a training step of it, with its activations kept for backward, fitted), at most 256, the same on every rank
(the smallest). Before it measures, one batch of training's micro-batch is evaluated unmeasured (what a first
forward makes once would otherwise count as that batch's), and on the CPU the C library's free heap is given back
to the kernel before each measured batch (memory freed earlier, by a checkpoint's write, say, and still
resident would be reused without showing: a checkpoint before the evaluation made the examples seem to cost
nothing, and 256 at once passed the limit). Three batches' forward is what this costs, once per run.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager

import torch

from polytrain.data.batches import eval_batches
from polytrain.devices import memory_limit
from polytrain.errors import MemoryLimitError
from polytrain.log import get_logger

#: --eval-batch-size when none is given and no --memory-limit bounds it
DEFAULT_EVAL_BATCH = 256
#: the share of the room left under --memory-limit that evaluation's batches are sized to
ROOM_SHARE = 0.8
#: the second measured batch is this many times training's micro-batch per worker (the first is one): a longer
#: lever on the bytes per example than the allocator's noise
PROBE_GROWTH = 4
MIB = float(1 << 20)


class EvalBatchSize:
    """Examples per evaluation batch per worker for one run: decided at its first evaluation."""

    def __init__(self, config: Any, global_batch: int, slices: int, test_examples: int):
        self.given = config.train.eval_batch_size
        self.limited = config.device.memory_limit is not None
        #: training's micro-batch per worker: a step of it fitted, activations for backward included
        self.micro = max(1, -(-global_batch // (max(1, slices) * max(1, config.train.accumulate))))
        self.per_worker = test_examples // max(1, slices)
        self.size: int | None = self.given if self.given is not None else \
            (DEFAULT_EVAL_BATCH if not self.limited else None)
        self.measured: dict[str, Any] = {}

    def decide(self, probe: Callable[[int], None], apart: Callable[[], ContextManager[Any]],
               agree: Callable[[int], list[int]]) -> int:
        """The size, measuring it the first time under a limit: ``probe(n)`` evaluates one batch of ``n``
        examples, ``apart()`` measures a block's peak (:meth:`~polytrain.train.memory.MemoryMeter.apart`),
        ``agree(n)`` gathers every trainer rank's number (every rank calls this, with the same collectives)."""
        if self.size is not None:
            return self.size
        small, large = self.micro, PROBE_GROWTH * self.micro
        if large > min(DEFAULT_EVAL_BATCH, self.per_worker):  # (no room to grow: training's batch)
            self.size = min(self.micro, DEFAULT_EVAL_BATCH)
            return self.size
        probe(small)  # unmeasured: what a first forward makes once (lazily made buffers, caches) is not an example's
        needs = []
        for count in (small, large):
            with apart() as measured:
                probe(count)
            needs.append(measured.need)
        room = memory_limit.room() or 0
        slope = (needs[1] - needs[0]) / (large - small)
        per_example = slope if slope > 0 else needs[1] / large
        fixed = max(0.0, needs[1] - per_example * large)
        fits = int((ROOM_SHARE * room - fixed) // max(per_example, 1.0))
        mine = max(self.micro, min(DEFAULT_EVAL_BATCH, fits))
        self.size = min(agree(mine))
        self.measured = {"eval_batch_size": self.size, "probe_bytes": needs, "room_bytes": room}
        get_logger().info(f"evaluation: {self.size} examples per batch per worker (what fits --memory-limit: "
                          f"{needs[0] / MIB:.1f} and {needs[1] / MIB:.1f} MiB measured for {small} and {large}, "
                          f"{room / MIB:.1f} MiB left)")
        return self.size


@torch.no_grad()
def evaluate(session: Any, topology: Any, batch: EvalBatchSize,
             apart: Callable[[], ContextManager[Any]]) -> tuple[float, float]:
    """The run's model on its test set (every trainer rank: each its slice of it, reduced over ``topology``): the
    mean loss and accuracy. The batches' size is ``batch``'s, decided here the first time under a limit
    (``apart``: the memory meter's measured block)."""
    s = session
    was_training = s.model.training
    s.model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=topology.device)  # loss, correct, units

    def probe(count: int) -> None:  # one batch of `count` examples, its result dropped (sizing the batches)
        for x, y in eval_batches(s.data.test, count, s.slice, topology.device):
            with s.devices.context():
                s.strategy.eval_step(x, y)
            return

    with memory_limit.evaluating(batch.size or batch.given or batch.micro):
        size = batch.decide(probe, apart, topology.all_gather_object)
    with memory_limit.evaluating(size):
        for x, y in eval_batches(s.data.test, size, s.slice, topology.device):
            with s.devices.context():
                part = s.strategy.eval_step(x, y)
            if part is not None:
                sums += part
    topology.all_reduce_sum(sums)
    s.model.train(was_training)
    loss_sum, correct, count = sums.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1)


def saved_first(exc: BaseException, step: int, saved: list[str]) -> BaseException:
    """The error of a final evaluation that failed after the run's result was written: past ``--memory-limit``,
    one line that also says where the model of ``step`` is (``saved``: the checkpoint and the ``--save-model``
    file written before the evaluation); any other error is left as it is."""
    if not isinstance(exc, MemoryLimitError):
        return exc
    where = "; ".join(saved) if saved else "nothing: the run has no --checkpoint-dir and no --save-model"
    return MemoryLimitError(f"{exc}; the final evaluation failed after step {step} was saved ({where})")
