"""One object for the trainer: the device settings of a run, applied to the model and to each step.

::

    runtime = DeviceRuntime(soft=cfg.soft_placement, log_placement=cfg.log_placement,
                            rank=rank, log_dir=log_dir)
    model = runtime.prepare(model, plan)          # place + module table (+ memory cap)
    optimizer = make_optimizer(model.parameters())
    for step, (x, y) in enumerate(batches):
        with runtime.step_context(step):
            loss = forward_backward(model, x, y)
            with runtime.phase("optimizer"):
                optimizer.step()

``step_context`` stacks, from the outside in: operator errors named with their device (always), the
per-operator log (on the logged steps), and the soft-placement operator fallback (with ``soft``). The log
is outside the fallback so it shows the failed call, the copies to the CPU and the rerun. Work outside
the training steps (evaluation) goes in ``context()``: the same without the log.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from polytrain.devices.memory import set_gpu_memory_fraction
from polytrain.devices.placement import model_devices, place
from polytrain.devices.placement_log import PlacementLogger
from polytrain.devices.plan import DeviceValue, PlacementPlan
from polytrain.devices.soft import SoftPlacementMode, operator_errors
from polytrain.devices.spec import LOGGER_NAME

_NOTHING = contextlib.nullcontext()  # (one, reused: a step's contexts allocate nothing)


class DeviceRuntime:
    """Placement, placement log, soft placement and the GPU memory cap of one worker."""

    def __init__(self, *, soft: bool = False, log_placement: bool = False, rank: int = 0, local_rank: int = 0,
                 log_dir: str | os.PathLike[str] | None = None, logger: logging.Logger | None = None,
                 gpu_memory_fraction: float | None = None, log_steps: Iterable[int] = (0,),
                 max_ops: int = 1000):
        self.soft = soft
        self.local_rank = local_rank
        self.logger = logger or logging.getLogger(LOGGER_NAME)
        self.gpu_memory_fraction = gpu_memory_fraction
        self.placement_logger = (PlacementLogger(rank=rank, log_dir=log_dir, logger=self.logger,
                                                 steps=log_steps, max_ops=max_ops) if log_placement else None)
        self.soft_mode = SoftPlacementMode(log=self.logger) if soft else None

    def prepare(self, model: nn.Module, plan: PlacementPlan | Mapping[str, DeviceValue] | str | None = None,
                *, home: torch.device | None = None) -> nn.Module:
        """Place ``model`` (if there is a plan), cap GPU memory on its devices, log the module table.

        Call it after moving the model to the worker's device ``home`` and before building the optimizer;
        the memory cap covers ``home`` too, where the batches live.
        """
        if plan:
            place(model, plan, soft=self.soft, log=self.logger, local_rank=self.local_rank)
        if self.gpu_memory_fraction is not None:
            devices = model_devices(model) + ([home] if home is not None else [])
            set_gpu_memory_fraction(self.gpu_memory_fraction, devices or [torch.device("cpu")], log=self.logger)
        if self.placement_logger is not None:
            self.placement_logger.log_model(model)
        return model

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Label the operators of a part of the step in the per-op log (e.g. ``"optimizer"``)."""
        active = self.placement_logger.active if self.placement_logger is not None else None
        return active.phase(name) if active is not None else _NOTHING

    def log_steps_from(self, first: int, count: int = 1) -> None:
        """Record the per-operator log of steps ``first`` .. ``first + count - 1`` (e.g. after a resume)."""
        if self.placement_logger is not None:
            self.placement_logger.steps = frozenset(range(first, first + count))

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Wrap work outside the training steps (evaluation): operator errors and soft placement, no log."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(operator_errors())
            if self.soft_mode is not None:
                stack.enter_context(self.soft_mode)
            yield

    @property
    def plain(self) -> bool:
        """Whether a step needs nothing but :func:`operator_errors` (no per-operator log, no soft placement)."""
        return self.placement_logger is None and self.soft_mode is None

    @property
    def recording(self) -> bool:
        """Whether the per-operator log is recording the step now running."""
        return self.placement_logger is not None and self.placement_logger.active is not None

    def step_context(self, step: int) -> contextlib.AbstractContextManager[None]:
        """Wrap training step ``step`` (counted from 0)."""
        if self.plain:
            return operator_errors()  # (one shared object, no generator)
        return self._step_context(step)

    @contextlib.contextmanager
    def _step_context(self, step: int) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(operator_errors())
            if self.placement_logger is not None:
                stack.enter_context(self.placement_logger.step_context(step))
            if self.soft_mode is not None:
                stack.enter_context(self.soft_mode)
            yield
