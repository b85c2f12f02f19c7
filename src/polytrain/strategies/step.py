"""What one training step gets back, and the default forward/backward over a slice.

A step gets a :class:`~polytrain.data.batches.Batch`: this rank's slice of one global batch, with the size
of the whole global batch in the task's units (examples, or real tokens for a language model), so every
rank can weigh its slice's loss without asking the others. :func:`forward_backward` is the step every data-parallel strategy shares:
micro-batches, each one's loss weighed by its share of the global batch, gradients exchanged (by the
strategy's ``grad_sync``/``backward``) after the last one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch import nn

from polytrain.data.batches import Batch
from polytrain.phases import labelling, phase
from polytrain.precision import Amp, Precision
from polytrain.tasks import model_loss_of


@dataclass(frozen=True)
class StepRecipe:
    """How a step computes its update, whatever the strategy: the task, gradient accumulation over
    ``accumulate`` micro-batches, clipping of the *global* gradient's norm (after the exchange), and whose
    loss is minimised (``loss``: ``task``, the task's loss on the model's outputs, or ``model``, the
    model's own ``.loss`` given ``labels=``), and in what ``precision`` (``--precision``: the strategy runs it
    through its ``amp``, unless it lists the mode in its ``traits.own_precision`` and carries it out itself)."""

    task: Any = None
    accumulate: int = 1
    clip_grad_norm: float | None = None
    loss: str = "task"
    precision: Precision = Precision()


@dataclass(frozen=True)
class RunSource:
    """What a strategy may draw on besides the batch the trainer hands each step: the batch and the learning
    rate of *any* step, and the run's length. A worker that takes work out of step order (``async`` with
    ``--tolerate-worker-loss``: a helper rank's own loop, or a slice of an earlier step that a lost worker
    handed back) uses it; ``after_slice(compute_s, step)`` runs what the trainer runs after its steps
    (``--straggler`` sleeps, an injected kill) for a slice of ``step`` that took ``compute_s`` seconds."""

    batch_at: Callable[[int], Batch]
    lr_at: Callable[[int], float]
    total_steps: int
    after_slice: Callable[[float, int], None] = lambda compute_s, step: None
    global_batch: int = 0  # examples in one step's batch


@dataclass
class StepResult:
    """What a rank reports of one step. ``loss`` is this rank's share of the global batch's mean loss, such
    that the mean over the ranks that hold a loss is that mean loss (a detached tensor on the device, read
    only at log points); ``None`` on a rank that computes no loss (a pipeline's first stages, a server)."""

    loss: torch.Tensor | None
    examples: int
    #: seconds of the step spent exchanging or waiting for other ranks (not computing): per-rank throughput
    wait_s: float = 0.0


def loss_divisor(global_units: int, replicas: int, units: int) -> float:
    """What the mean loss of a micro-batch of ``units`` is divided by so that it weighs its share of a global
    batch of ``global_units``, when the exchange averages the gradients of ``replicas`` ranks."""
    return global_units / (replicas * max(units, 1))


def forward_backward(model: nn.Module, batch: Batch, task: Any, replicas: int, accumulate: int,
                     grad_sync: Callable[[nn.Module, bool], ContextManager[Any]],
                     backward: Callable[[torch.Tensor], None], loss: str = "task",
                     amp: Amp | None = None) -> torch.Tensor:
    """Gradients of the global batch's mean loss over this slice, in ``accumulate`` micro-batches.

    The gradients of ``replicas`` data-parallel ranks are averaged by the exchange, so a micro-batch holding
    ``u`` of the global batch's ``U`` units divides its mean loss by ``U / (replicas * u)``: the average is
    then the gradient of the mean over all ``U`` units, whatever the slices hold. For equal slices of
    examples in K micro-batches the divisor is exactly K. Returns the summed, weighed loss (detached).

    ``loss="model"`` takes the model's own mean loss instead (``model(x, labels=...)``), weighed the same
    way by the units *it* averages over, which the task says (:meth:`Task.model_labels` and friends).

    ``amp`` (``--precision``): forward and loss under its autocast, inputs in its dtype, and ``backward``
    given the scaled loss (16-mixed); the returned loss is unscaled.
    """
    amp = amp or _FLOAT32
    micro_loss = _task_loss if loss == "task" else _model_loss
    global_units = batch.global_units if loss == "task" else _model_global_units(task, batch, replicas)
    if accumulate == 1:  # one micro-batch: no chunks, no running sum (a step's fixed cost is its Python and ops)
        x = batch.inputs
        sync = grad_sync(model, True)
        if amp.idle and type(sync) is contextlib.nullcontext and not labelling():
            # nothing to enter: the same computation without six no-op contexts (a tiny model's step is
            # mostly Python calls, each of which shows)
            mean, units = micro_loss(model, task, x, batch.targets)
            divisor = loss_divisor(global_units, replicas, units)
            weighed = mean / divisor if divisor != 1 else mean  # (x / 1 is x: the same bits either way)
            backward(weighed)
        else:
            with sync:
                with phase("forward"), amp.autocast():
                    mean, units = micro_loss(model, task, amp.inputs(x), batch.targets)
                    divisor = loss_divisor(global_units, replicas, units)
                    weighed = mean / divisor if divisor != 1 else mean
                with phase("backward"):
                    backward(amp.scale(weighed))
        out = weighed.detach()
        return out if out.dtype is torch.float32 and out.device == x.device else out.to(x.device, torch.float32)
    total = torch.zeros((), device=batch.inputs.device)
    pieces = list(zip(amp.inputs(batch.inputs).chunk(accumulate), batch.targets.chunk(accumulate)))
    for i, (x, y) in enumerate(pieces):
        with grad_sync(model, i == len(pieces) - 1):
            with phase("forward"), amp.autocast():
                mean, units = micro_loss(model, task, x, y)
                weighed = mean / loss_divisor(global_units, replicas, units)
            with phase("backward"):
                backward(amp.scale(weighed))
        total += weighed.detach().to(total.device)
    return total


_FLOAT32 = Amp()  # 32-true: no autocast, no cast, no scale


def _task_loss(model: nn.Module, task: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The task's mean loss on the model's outputs for one micro-batch, and the units it averages over."""
    kwargs = task.model_kwargs(x)
    return task.loss(model(x, **kwargs) if kwargs else model(x), y), task.units(y)


def _model_loss(model: nn.Module, task: Any, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The model's own mean loss on one micro-batch, and the units it averages over."""
    labels = task.model_labels(x, y)
    return model_loss_of(model(x, labels=labels, **task.model_kwargs(x))), task.model_units(labels)


def _model_global_units(task: Any, batch: Batch, replicas: int) -> int:
    # a batch made without its global example count comes from equal slices (every strategy's default)
    examples = batch.global_examples if batch.global_examples is not None else len(batch) * replicas
    return task.model_global_units(batch.global_units, examples)
