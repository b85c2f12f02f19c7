"""``--precision``: the numeric precision of training, by Lightning's names, for every strategy.

* ``32-true`` (the default): float32 parameters, compute, gradients and optimizer state; nothing is added.
* ``bf16-mixed``: forward and loss under ``torch.autocast`` to bfloat16 on the worker's device (in training
  and evaluation); parameters, gradients and optimizer state stay float32 (the *master weights*).
* ``16-mixed``: the same with float16, and a loss scaler (``torch.amp.GradScaler`` on the device): each
  micro-batch's loss is multiplied by the scale before its backward, the gradients are divided by it after
  the exchange (so ``--clip-grad-norm`` clips the true, exchanged gradient), and a step whose gradients hold
  an inf or NaN is skipped, the scale halved; the scale doubles after 2000 good steps. Skipped steps are
  counted (``rank_precision_skipped_steps`` at each log point, ``precision_skipped_steps`` in the summary).
* ``bf16-true``: the model's parameters and buffers cast to bfloat16 after it is built, before the strategy
  prepares it, so gradients and optimizer state are bfloat16 too; floating inputs are cast to bfloat16; no
  autocast.

:class:`Precision` is the setting (it travels in the :class:`~polytrain.strategies.step.StepRecipe`);
:class:`Amp` is one rank's precision at run time (its autocast, loss scaler and counts), held by the
strategy as ``strategy.amp``. A strategy that carries a mode out itself (FSDP's ``MixedPrecisionPolicy``)
lists it in its ``own_precision``: the run then adds nothing for that mode and the strategy reads
``recipe.precision`` in ``prepare``.

Files: checkpoints and ``--save-model`` hold float32 tensors in every mode (the mixed modes' parameters
and optimizer state are float32 anyway; bf16-true's bfloat16 values are widened to float32, which is
exact), so any checkpoint resumes under any precision: into bf16-true its values are rounded to bfloat16
once, out of it nothing changes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ContextManager

import torch
from torch import nn

from polytrain.errors import ConfigError, DeviceError

#: the --precision names (Lightning's)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")
DEFAULT_PRECISION = "32-true"
#: torch.amp.GradScaler's own first scale
DEFAULT_LOSS_SCALE = 2.0 ** 16
_NOTHING = contextlib.nullcontext()  # (one, reused: a step's contexts allocate nothing)

_AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


@dataclass(frozen=True)
class Precision:
    """One ``--precision`` mode (and the loss scaler's first scale, read by ``16-mixed`` only)."""

    name: str = DEFAULT_PRECISION
    initial_loss_scale: float = DEFAULT_LOSS_SCALE

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"unknown precision '{self.name}'; accepted: {', '.join(PRECISIONS)}")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """What forward and loss compute in under autocast (None: no autocast)."""
        return _AUTOCAST.get(self.name)

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the parameters, gradients and optimizer state."""
        return torch.bfloat16 if self.name == "bf16-true" else torch.float32

    @property
    def scaled(self) -> bool:
        """Whether the loss is scaled (and steps with overflowing gradients skipped)."""
        return self.name == "16-mixed"

    def describe(self) -> str:
        if self.autocast_dtype is not None:
            text = (f"{self.name}: forward and loss under autocast to {_short(self.autocast_dtype)}, float32 "
                    "parameters, gradients and optimizer state")
            if self.scaled:
                text += (f"; loss scaled (initial scale {self.initial_loss_scale:g}), steps with inf/NaN "
                         "gradients skipped and counted")
            return text
        if self.name == "bf16-true":
            return "bf16-true: parameters, gradients and optimizer state in bfloat16, no autocast"
        return "32-true: float32 parameters, compute and optimizer state"


def precision_of(config: Any) -> Precision:
    """The run's :class:`Precision` from its config's ``train`` section."""
    return Precision(config.train.precision, float(config.train.initial_loss_scale))


def check_precision(config: Any) -> None:
    """Settings of ``--precision`` that cannot work, as one line before anything starts (the strategies
    refuse what they cannot do in their own ``check``)."""
    train = config.train
    if train.precision != "16-mixed" and float(train.initial_loss_scale) != DEFAULT_LOSS_SCALE:
        raise ConfigError(f"--initial-loss-scale is read by --precision 16-mixed only (this run has --precision "
                          f"{train.precision}, which scales no loss); drop it or pass --precision 16-mixed")


def refuse_loss_scaling(config: Any, strategy: str, why: str) -> None:
    """The one line of a strategy that cannot scale the loss, when ``--precision 16-mixed`` asks it to."""
    if config.train.precision == "16-mixed":
        raise ConfigError(f"--precision 16-mixed needs a loss scaler, which --strategy {strategy} cannot apply "
                          f"({why}); use --precision bf16-mixed (no loss scaling needed) or 32-true")


def cast_model(model: nn.Module, precision: Precision, own_precision: tuple[str, ...] = ()) -> nn.Module:
    """The model as ``precision`` trains it, after it is built and before the strategy prepares it:
    bf16-true casts its floating parameters and buffers to bfloat16 (in place, as ``Module.to`` does);
    every other mode, and a mode the strategy carries out itself, leaves it as it is."""
    if precision.name == "bf16-true" and precision.name not in own_precision:
        return model.to(torch.bfloat16)
    return model


def to_float32(state: Any) -> Any:
    """``state`` (a checkpoint's model and optimizer state, nested) with every bfloat16 tensor widened to
    float32, which is exact; anything else is returned as it is (the same objects)."""
    if isinstance(state, torch.Tensor):
        return state.float() if state.dtype == torch.bfloat16 else state
    if isinstance(state, dict):
        return {key: to_float32(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(to_float32(value) for value in state)
    return state


def file_signature(signature: list[list[Any]], precision: Precision) -> list[list[Any]]:
    """The signature (names, shapes, dtypes) of what a checkpoint of a model with ``signature`` holds under
    ``precision``: bf16-true's bfloat16 tensors are saved as float32."""
    if precision.name != "bf16-true":
        return signature
    return [[name, shape, "float32" if dtype == "bfloat16" else dtype] for name, shape, dtype in signature]


def resume_note(saved_config: dict[str, Any], precision: Precision) -> str | None:
    """What a resume across precisions does to the checkpoint's values (None: the same precision)."""
    saved = saved_config.get("precision", DEFAULT_PRECISION)
    if saved == precision.name:
        return None
    if precision.name == "bf16-true":
        what = "its float32 parameters and optimizer state are rounded to bfloat16 once"
    elif saved == "bf16-true":
        what = "its bfloat16 values continue in float32 unchanged"
    else:
        what = "the float32 parameters and optimizer state continue unchanged"
    return f"--resume: the checkpoint was trained with --precision {saved}, this run has {precision.name}: {what}"


class Amp:
    """One rank's precision at run time: the autocast around forward and loss, the inputs' cast, and for
    ``16-mixed`` the loss scaler with its count of skipped steps. With ``active=False`` (a mode the strategy
    carries out itself) it does nothing but name the mode."""

    def __init__(self, precision: Precision | None = None, device: torch.device | str = "cpu",
                 active: bool = True):
        self.precision = precision or Precision()
        self.device = torch.device(device)
        self.active = active
        self._dtype = self.precision.autocast_dtype if active else None
        if self._dtype is not None:
            _check_autocast(self.device, self._dtype, self.precision.name)
        self.scaler = (torch.amp.GradScaler(self.device.type, init_scale=self.precision.initial_loss_scale)
                       if active and self.precision.scaled else None)
        self._cast_inputs = active and self.precision.name == "bf16-true"
        #: whether it does nothing in a step (no autocast, no cast, no scale): 32-true, or a mode the strategy
        #: carries out itself
        self.idle = self._dtype is None and self.scaler is None and not self._cast_inputs
        self.skipped = 0  # steps skipped since the last take_metrics()
        self.skipped_total = 0

    def describe(self) -> str:
        return self.precision.describe() if self.active else f"{self.precision.name}, carried out by the strategy"

    # -- the step ---------------------------------------------------------------------------------------

    def autocast(self) -> ContextManager[Any]:
        """Around forward and loss (never backward): autocast to the mode's dtype, or nothing."""
        if self._dtype is None:
            return _NOTHING
        return torch.autocast(self.device.type, dtype=self._dtype)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        """The model's inputs: floating ones in bfloat16 under bf16-true (integer tokens stay as they are)."""
        return x.to(torch.bfloat16) if self._cast_inputs and x.is_floating_point() else x

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to run backward on: multiplied by the loss scale under 16-mixed, else ``loss`` itself."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients divided by the loss scale, in place: after the exchange, before clipping."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's step; under 16-mixed skipped when the gradients hold an inf or NaN (counted), and
        the scale updated. The scaler reads its inf check on the host, as ``GradScaler.step`` always does."""
        if self.scaler is None:
            optimizer.step()
            return
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        if self.scaler.get_scale() < before:  # the scale only falls when the step was skipped
            self.skipped += 1
            self.skipped_total += 1

    # -- numbers and state ------------------------------------------------------------------------------

    def take_metrics(self) -> dict[str, float]:
        """Steps skipped since the last call and the current scale (16-mixed only; else nothing)."""
        if self.scaler is None:
            return {}
        out = {"precision_skipped_steps": self.skipped, "loss_scale": self.scaler.get_scale()}
        self.skipped = 0
        return out

    def summary(self, trainers: Any) -> dict[str, Any]:
        """The run's skipped steps over the trainer ranks (a collective over them; 16-mixed only). Each rank
        skips its own steps: equal on every rank where the gradients are exchanged before the update."""
        if self.scaler is None:
            return {}
        per_rank = trainers.all_gather_object((self.skipped_total, self.scaler.get_scale()))
        return {"precision_skipped_steps": max(skipped for skipped, _ in per_rank),
                "rank_precision_skipped_steps": [skipped for skipped, _ in per_rank],
                "precision_loss_scale": per_rank[0][1]}

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of the scaler (nothing without one)."""
        return {"loss_scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The scaler's state from a checkpoint that has one (one of another precision: the initial scale)."""
        if self.scaler is not None and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])


def _check_autocast(device: torch.device, dtype: torch.dtype, name: str) -> None:
    """torch.autocast only warns and turns itself off where it cannot run: refuse instead."""
    if not torch.amp.is_autocast_available(device.type):
        raise DeviceError(f"--precision {name}: torch has no autocast on {device.type}; use --precision 32-true "
                          "or another device")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise DeviceError(f"--precision {name}: {torch.cuda.get_device_name(device)} does not compute in "
                          "bfloat16; use --precision 16-mixed")


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
