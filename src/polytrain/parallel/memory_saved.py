"""Activations planned: the bytes autograd saves for backward on one forward (and the task's loss) of a
micro-batch, counted by the same :class:`~polytrain.train.memory.SavedTensors` the run measures them with, over
fake tensors of the run's device type (``FakeTensorMode``: shapes and dtypes, no memory), the whole model's or
each pipeline stage's (:mod:`polytrain.parallel.memory_plan`)."""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from polytrain.train.memory import SavedTensors


@dataclass
class Inputs:
    """One micro-batch's shapes and dtypes (from the data's first examples)."""

    inputs: tuple[tuple[int, ...], torch.dtype]
    targets: tuple[tuple[int, ...], torch.dtype]

    def make(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        (x, xd), (y, yd) = self.inputs, self.targets
        return (torch.zeros((batch, *x), dtype=xd, device=device), torch.zeros((batch, *y), dtype=yd, device=device))


def sample(data: Any) -> Inputs:
    dataset = data.train
    count = 1 if data.streamed else min(2, len(dataset))
    if data.streamed:  # (rows of seq_len tokens: nothing is read for their shape)
        x, y = (t.unsqueeze(0) for t in data.shape_example())
    elif hasattr(dataset, "get_batch"):
        x, y = dataset.get_batch(torch.arange(count), 0)
    else:
        x, y = torch.utils.data.default_collate([dataset[i] for i in range(count)])
    x_shape, y_shape = tuple(x.shape[1:]), tuple(y.shape[1:])
    if data.task == "lm" and data.seq_len and x_shape:  # the longest sequence: the most a step can hold
        x_shape, y_shape = (data.seq_len, *x_shape[1:]), (data.seq_len, *y_shape[1:]) if y_shape else y_shape
    return Inputs((x_shape, x.dtype), (y_shape, y.dtype))


def data_bytes(data: Any) -> int | None:
    """The bytes of the dataset's in-memory tensors (train and test), when it keeps them as tensors."""
    total = 0
    for part in (data.train, data.test):
        if part is None:
            continue
        tensors = [v for v in vars(part).values() if isinstance(v, torch.Tensor)]
        if not tensors:
            return None
        total += sum(t.untyped_storage().nbytes() for t in tensors)
    return total


class _Fake:
    """The meta model's copy on fake tensors of ``device`` (shapes and dtypes, no memory), for forwards."""

    def __init__(self, model: nn.Module, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.model = copy.deepcopy(model)
        convert = self.mode.fake_tensor_converter.from_meta_and_device
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    fake = convert(self.mode, param.detach(), device)
                    module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
            for name, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[name] = convert(self.mode, buffer, device)


@dataclass(frozen=True)
class Forward:
    """How a run's forward goes: under autocast to ``autocast`` (None: none), with the units named in
    ``checkpointed`` under activation checkpointing."""

    autocast: torch.dtype | None = None
    checkpointed: tuple[str, ...] = ()


def _saved(model: nn.Module, stages: list[list[str]] | None, inputs: Inputs, batch: int, task: Any,
           device: torch.device, forward: Forward = Forward()) -> list[int]:
    """The bytes saved for backward by one micro-batch of ``batch`` examples on ``device`` (fake tensors; the
    meta device as it is): the whole model's forward and loss (``stages`` None), or each stage's (its units
    in order, the last with the loss), each stage's input a tensor of its own, as a pipeline stage receives it."""
    from polytrain.train.unit_options import checkpoint_unit

    if device.type == "meta":
        mode, whole = contextlib.nullcontext(), copy.deepcopy(model)
    else:
        fake = _Fake(model, device)
        mode, whole = fake.mode, fake.model
    units = dict(whole.named_modules())
    for name in forward.checkpointed:
        checkpoint_unit(units[name])
    cast = (torch.autocast(device.type, forward.autocast) if forward.autocast is not None and device.type != "meta"
            else contextlib.nullcontext())
    found = []
    with mode, cast:
        x, y = inputs.make(batch, device)
        for index, stage in enumerate(stages or [[""]]):  # "": the whole model
            counter = SavedTensors(shapes=True)  # (its forward runs on fake or meta tensors)
            if index:
                x = x.detach().clone().requires_grad_(x.is_floating_point())
            with counter.hooks():
                for unit in stage:
                    x = units[unit](x)
                if index == len(stages or [[""]]) - 1:
                    task.loss(x, y)
            found.append(counter.peak)
    return found


def saved_bytes(model: nn.Module, stages: list[list[str]] | None, inputs: Inputs, batch: int,
                task: Any, device: torch.device, forward: Forward = Forward()) -> tuple[list[int] | None, str]:
    """:func:`_saved` on fake tensors of ``device``, or, if that forward fails, on the meta device (with
    why); None if both fail (and why)."""
    tried: list[str] = []
    for where in dict.fromkeys([device, torch.device("meta")]):
        try:
            found = _saved(model, stages, inputs, batch, task, where, forward)
        except Exception as exc:  # noqa: BLE001 - a forward that needs real values: say so, estimate the rest
            first = str(exc).splitlines()[0] if str(exc) else ""
            tried.append(f"a forward on {where.type} {'fake ' if where.type != 'meta' else ''}tensors failed "
                         f"({type(exc).__name__}: {first})")
            continue
        return found, (f"counted on the meta device, whose kernels may save other tensors: {'; '.join(tried)}"
                       if tried else "")
    return None, "not estimated: " + "; ".join(tried)
