"""Resuming at another global batch: where the data continues, how many steps are left, and the LR.

A checkpoint saves its data position in examples: the epoch, how many examples of that epoch's permutation
were consumed, and where that epoch stops (``data_position``). A run resumed with the same global batch at
a batch boundary continues on the unchanged plan (bit for bit the uninterrupted run). With another global
batch the epoch in progress continues from the example reached, in batches of the new size, up to where the
saved run would have stopped it, so the examples consumed after the resume are the ones the uninterrupted
run would have consumed; whole epochs after it are the new batch size's own. ``--epochs E`` still ends at
the end of epoch E; ``--steps N`` still ends at optimizer step N (steps of the new size from the resume).

The learning rate follows the new global batch (``--lr-scaling``); rather than jumping there it moves
linearly from the rate the saved run would have used next, over ``--rescale-warmup-steps`` steps.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from polytrain.data.batches import BatchPlan, Resumed
from polytrain.errors import ConfigError
from polytrain.train.lr_schedules import LRSchedule


@dataclass(frozen=True)
class DataPosition:
    """How far into the data a checkpoint's run was."""

    epoch: int
    #: examples of the epoch's permutation consumed
    examples: int
    #: where the saved run stops the epoch (its examples; the ragged rest of the permutation is dropped)
    epoch_examples: int
    global_batch: int

    @classmethod
    def at(cls, plan: BatchPlan, step: int) -> DataPosition:
        """Where ``plan`` is before global step ``step``."""
        epoch, examples, end = plan.locate(step)
        return cls(epoch, examples, end, plan.global_batch)

    @classmethod
    def saved(cls, state: dict[str, Any], num_examples: int) -> DataPosition:
        """The position a checkpoint holds; one written before positions were saved in examples holds
        epoch and batch, which the plain plan of its global batch turns into examples."""
        saved = state["data_position"]
        batch = int(saved["global_batch"])
        examples = saved.get("examples", int(saved["batch"]) * batch)
        end = saved.get("epoch_examples", num_examples // batch * batch)
        position = cls(int(saved["epoch"]), int(examples), int(end), batch)
        if not 0 <= position.examples <= position.epoch_examples <= num_examples:
            raise ConfigError(f"--resume: the checkpoint stopped at example {position.examples} of epoch "
                              f"{position.epoch}'s {position.epoch_examples}, which does not fit this training set "
                              f"of {num_examples} examples: it was made on other data; resume on the data it was "
                              "made with, or use another --checkpoint-dir")
        return position

    def as_dict(self) -> dict[str, int]:
        # "batch" for readers that predate "examples" (polytrain checkpoint inspect, older polytrain)
        return {"epoch": self.epoch, "batch": self.examples // self.global_batch, "examples": self.examples,
                "epoch_examples": self.epoch_examples, "global_batch": self.global_batch}


def continue_plan(plan: BatchPlan, position: DataPosition, step: int) -> BatchPlan:
    """The plan that continues ``position`` at global step ``step``: ``plan`` itself where it already does
    (same batch, a batch boundary of the plain plan), else ``plan`` taking over the epoch in progress."""
    if plan.resumed is None and DataPosition.at(plan, step) == position:
        return plan
    return dataclasses.replace(plan, resumed=Resumed(step, position.epoch, position.examples,
                                                     position.epoch_examples))


def skipped_examples(plan: BatchPlan) -> int:
    """Examples of the resumed epoch left out because the new batch does not divide what was left of it."""
    r = plan.resumed
    return 0 if r is None else (r.end - r.offset) % plan.global_batch


def total_steps(plan: BatchPlan, steps: int | None, epochs: int | None) -> int:
    """Where the run ends: ``--steps N`` at step N whatever the batch; ``--epochs E`` at the end of epoch E."""
    return steps if steps else plan.epoch_start(int(epochs or 1))


@dataclass(frozen=True)
class Rescaled:
    """``lr_schedule``, but for ``steps`` steps from ``start`` moving linearly from ``from_lr`` to it: step
    ``start + j`` runs at ``from_lr + (lr_schedule(start + j) - from_lr) * (j + 1) / (steps + 1)``."""

    lr_schedule: LRSchedule
    start: int
    from_lr: float
    steps: int

    @property
    def base_lr(self) -> float:
        return self.lr_schedule.base_lr

    def lr_at(self, step: int) -> float:
        target = self.lr_schedule(step)
        j = step - self.start
        if not 0 <= j < self.steps:
            return target
        return self.from_lr + (target - self.from_lr) * (j + 1) / (self.steps + 1)

    __call__ = lr_at

    def __str__(self) -> str:
        return str(self.lr_schedule)


def saved_lr(state: dict[str, Any]) -> float | None:
    """The LR the checkpoint's run would have used at its next step (older checkpoints: its last step's)."""
    if "lr" in state:
        return float(state["lr"])
    groups = (state.get("optimizer") or {}).get("param_groups") or []
    return float(groups[0]["lr"]) if groups else None
