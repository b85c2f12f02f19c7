"""Soft placement for operators: run on the CPU what a device cannot run (opt-in), else say so clearly.

With soft placement (``--soft-placement`` / ``soft=True``), :class:`SoftPlacementMode` catches the
``NotImplementedError`` PyTorch raises for an operator that has no kernel for its device, moves the
operator's inputs to the CPU, runs it there, copies results of in-place operators back into the original
tensors and moves the outputs back to the device, logging once per operator. It is the general form of
PyTorch's MPS-only ``PYTORCH_ENABLE_MPS_FALLBACK=1``. Each operator passes through Python while the mode is
active, so it costs some speed; that is why it is opt-in.

Without soft placement, :func:`operator_errors` turns PyTorch's "not implemented for this backend"
errors into a :class:`~polytrain.errors.DeviceError` that names the operator, the device and the available
devices, at no cost while nothing fails.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from polytrain.devices.discovery import available_device_names
from polytrain.devices.placement import to_device
from polytrain.devices.spec import LOGGER_NAME
from polytrain.errors import DeviceError
from polytrain.log import EVERY_RANK

# PyTorch's wording for a missing kernel, with the operator and the backend it lacks
_MISSING_KERNEL = (
    re.compile(r"Could not run '(?P<op>[\w:.]+)' with arguments from the '(?P<backend>\w+)' backend"),
    re.compile(r"The operator '(?P<op>[\w:.]+)' is not currently implemented for the (?P<backend>\w+) device"),
    re.compile(r"^(?P<op>\w+::[\w.]+): attempted to run this operator with (?P<backend>\w+) tensors"),
)
_BACKEND_DEVICES = {"sparsecuda": "cuda", "quantizedcuda": "cuda", "sparsecpu": "cpu", "quantizedcpu": "cpu"}


class SoftPlacementMode(TorchDispatchMode):
    """Run operators that are not implemented for their device on ``fallback`` (the CPU) instead.

    ``fallen_back`` counts the calls rerun, per operator. The mode object can be entered again and again
    (e.g. once per training step); each operator is logged the first time only.
    """

    def __init__(self, *, fallback: str | torch.device = "cpu", log: logging.Logger | None = None):
        super().__init__()
        self.fallback = torch.device(fallback)
        self.log = log or logging.getLogger(LOGGER_NAME)
        self.fallen_back: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except NotImplementedError as exc:
            home = _first_device_other_than((args, kwargs), self.fallback)
            if home is None:  # already on the fallback device: nothing softer to try
                raise
            return self._rerun(func, args, kwargs, home, exc)

    def _rerun(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], home: torch.device,
               exc: NotImplementedError) -> Any:
        name = func.name()
        if name not in self.fallen_back:
            self.log.warning("soft placement: operator %s is not implemented for %s (%s); running it on %s with "
                             "its inputs moved there and its outputs moved back (logged once per operator)",
                             name, home, _first_line(exc), self.fallback, extra=EVERY_RANK)
        self.fallen_back[name] = self.fallen_back.get(name, 0) + 1
        moved_args, moved_kwargs = to_device(args, self.fallback), to_device(kwargs, self.fallback)
        try:
            out = func(*moved_args, **moved_kwargs)
        except NotImplementedError as again:
            raise DeviceError(f"operator {name} is implemented neither for {home} nor for {self.fallback}: "
                              f"{_first_line(again)}") from exc
        originals = _write_back(func, (args, kwargs), (moved_args, moved_kwargs))
        return _outputs_home(out, originals, home)


def _first_device_other_than(obj: Any, fallback: torch.device) -> torch.device | None:
    if isinstance(obj, torch.Tensor):
        return obj.device if obj.device != fallback else None
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        found = _first_device_other_than(item, fallback)
        if found is not None:
            return found
    return None


def _write_back(func: Any, original: tuple[tuple[Any, ...], dict[str, Any]],
                moved: tuple[tuple[Any, ...], dict[str, Any]]) -> dict[int, torch.Tensor]:
    """Copy the results of arguments the operator writes (``Tensor(a!)``) back into the originals.

    Returns ``{id(moved copy): original}`` so outputs that alias a written argument map to the original.
    """
    (args, kwargs), (moved_args, moved_kwargs) = original, moved
    pairs: dict[int, torch.Tensor] = {}
    for position, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if position < len(args):
            before, after = args[position], moved_args[position]
        elif argument.name in kwargs:
            before, after = kwargs[argument.name], moved_kwargs[argument.name]
        else:
            continue
        for orig, copy in _tensor_pairs(before, after):
            if orig is not copy:
                orig.copy_(copy)
                pairs[id(copy)] = orig
    return pairs


def _tensor_pairs(before: Any, after: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if isinstance(before, torch.Tensor):
        return [(before, after)]
    if isinstance(before, (tuple, list)):
        return [pair for b, a in zip(before, after) for pair in _tensor_pairs(b, a)]
    return []


def _outputs_home(out: Any, originals: dict[int, torch.Tensor], home: torch.device) -> Any:
    if isinstance(out, torch.Tensor):
        original = originals.get(id(out))
        return original if original is not None else out.to(home)
    if isinstance(out, (tuple, list)):
        return type(out)([_outputs_home(item, originals, home) for item in out])
    return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def device_error_for(exc: NotImplementedError) -> DeviceError | None:
    """A DeviceError naming the operator, device and available devices, if ``exc`` is PyTorch's
    missing-kernel error; None for any other NotImplementedError (e.g. one raised by user code)."""
    text = str(exc)
    for pattern in _MISSING_KERNEL:
        match = pattern.search(text)
        if match:
            backend = match["backend"].lower()
            device = _BACKEND_DEVICES.get(backend, backend)
            advice = ("soft placement cannot help, the CPU being its fallback; run that part on another device"
                      if device == "cpu" else
                      "rerun with --soft-placement (soft=True) to run it on the CPU, or place the module that "
                      "uses it on cpu (--place MODULE=cpu)")
            return DeviceError(f"operator {match['op']} is not implemented for device {device}; available "
                               f"devices: {', '.join(available_device_names())}; {advice}")
    return None


class _OperatorErrors:
    """The context :func:`operator_errors` returns: one object for every use (it holds nothing), entered at every
    training step at the cost of two method calls."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> bool:
        if kind is not None and issubclass(kind, NotImplementedError):
            error = device_error_for(exc)  # type: ignore[arg-type]
            if error is not None:
                raise error from exc
        return False


_OPERATOR_ERRORS = _OperatorErrors()


def operator_errors() -> contextlib.AbstractContextManager[None]:
    """Turn PyTorch's missing-kernel NotImplementedError raised inside the block into a DeviceError."""
    return _OPERATOR_ERRORS
