"""Explicit placement: sub-modules on chosen devices inside one process (simple model parallelism).

``place(model, {"features": "cuda:0", "classifier": "cuda:1"})`` moves each matched sub-module (see
:mod:`polytrain.devices.plan` for the matching rules) and installs a forward pre-hook on every module that
owns parameters or buffers: the hook moves the module's tensor inputs to the device of those parameters.
Autograd records those moves, so the backward pass carries gradients back across devices by itself: the
placed model trains with an unchanged loop, and an optimizer built *after* ``place`` works as usual.

``with polytrain.device("cuda:1"): layer = nn.Linear(...)`` builds modules directly on a device, the
counterpart of ``with tf.device(...)``.

Limit: the hooks move the inputs *of modules*. Code in a parent's ``forward`` that combines the outputs of
children on different devices (``self.a(x) + self.b(x)``) must move one of them itself, or keep both
children on one device.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from polytrain.devices.plan import DeviceValue, PlacementPlan
from polytrain.devices.spec import LOGGER_NAME, resolve_device
from polytrain.errors import DeviceError

_PARSED_TYPES = ("cpu", "cuda", "mps")
_hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def place(model: nn.Module, plan: PlacementPlan | Mapping[str, DeviceValue] | str, *, soft: bool = False,
          log: logging.Logger | None = None, local_rank: int = 0) -> nn.Module:
    """Put the sub-modules of ``model`` on the devices ``plan`` names; return ``model`` (moved in place).

    ``soft`` lets an unavailable device fall back (CPU, or another visible GPU), one warning per device;
    without it such a device raises DeviceError listing the available ones. ``cuda`` and ``auto`` in the
    plan mean this worker's GPU (``local_rank``). Build the optimizer after calling this.
    """
    log = log or logging.getLogger(LOGGER_NAME)
    plan = PlacementPlan.coerce(plan)
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    assigned = plan.assign(names)
    resolved = {value: _resolve(value, soft, log, local_rank) for value in plan.devices()}
    targets = {name: resolved[value] for name, value in assigned.items()}
    _check_shared(model, targets)
    _move(model, targets)
    install_input_hooks(model)
    log.info("placement: %s", ", ".join(f"{p or '(root)'} -> {resolved[v]}" for p, v in plan.entries))
    return model


def _resolve(value: DeviceValue, soft: bool, log: logging.Logger, local_rank: int) -> torch.device:
    # devices polytrain does not parse (meta, lazy, xla, ...) are taken as given from Python callers
    if isinstance(value, torch.device) and value.type not in _PARSED_TYPES:
        return value
    return resolve_device(str(value), local_rank=local_rank, soft=soft, log=log)


def _check_shared(model: nn.Module, targets: Mapping[str, torch.device]) -> None:
    """A module or parameter reachable under two names cannot be on two devices (e.g. tied embeddings)."""
    seen: dict[int, tuple[str, torch.device]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        target = targets.get(name)
        if target is None:
            continue
        owned = [(name, module)] + [
            (f"{name}.{key}" if name else key, tensor)
            for key, tensor in [*module._parameters.items(), *module._buffers.items()] if tensor is not None
        ]
        for label, obj in owned:
            first = seen.setdefault(id(obj), (label, target))
            if first[1] != target:
                raise DeviceError(f"'{first[0]}' and '{label}' are the same {type(obj).__name__} (shared or tied) "
                                  f"but placed on {first[1]} and {target}; place both on one device")


def _move(model: nn.Module, targets: Mapping[str, torch.device]) -> None:
    """Move each placed subtree, shallow first, so deeper placements override their ancestors'."""
    modules = dict(model.named_modules(remove_duplicate=False))
    for name in sorted(targets, key=lambda n: 0 if not n else n.count(".") + 1):
        parent = name.rpartition(".")[0] if name else None
        if parent is not None and targets.get(parent) == targets[name]:
            continue  # already moved with its parent
        modules[name].to(targets[name])


def install_input_hooks(model: nn.Module) -> int:
    """Hook every module of ``model`` that owns tensors so its inputs follow its parameters; return the count.

    Idempotent: a module is hooked once however often this runs.
    """
    count = 0
    for module in model.modules():
        if _own_device(module) is not None and module not in _hooked:
            _hook(module)
            count += 1
    return count


def _hook(module: nn.Module) -> None:
    module.register_forward_pre_hook(_move_inputs, with_kwargs=True)
    _hooked.add(module)


def _own_device(module: nn.Module) -> torch.device | None:
    """The device of the module's own (not its children's) parameters or buffers; None if it owns none."""
    for tensor in module.parameters(recurse=False):
        return tensor.device
    for tensor in module.buffers(recurse=False):
        return tensor.device
    return None


def _move_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # read the device at call time, so a later model.to(...) keeps working with the hooks in place
    target = _own_device(module)
    if target is None or not _needs_move((args, kwargs), target):
        return None
    return to_device(args, target), to_device(kwargs, target)


def _needs_move(obj: Any, target: torch.device) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.device != target
    if isinstance(obj, (tuple, list)):
        return any(_needs_move(item, target) for item in obj)
    if isinstance(obj, dict):
        return any(_needs_move(item, target) for item in obj.values())
    return False


def to_device(obj: Any, target: torch.device) -> Any:
    """``obj`` with every tensor in it (through tuples, named tuples, lists and dicts) moved to ``target``.

    Copies are blocking: a non-blocking copy to the CPU could be read before it lands.
    """
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == target else obj.to(target)
    if isinstance(obj, tuple):
        items = [to_device(item, target) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, list):
        return [to_device(item, target) for item in obj]
    if isinstance(obj, dict):
        return type(obj)((key, to_device(item, target)) for key, item in obj.items())
    return obj


@contextlib.contextmanager
def device(spec: str | torch.device, *, soft: bool = False, log: logging.Logger | None = None,
           local_rank: int = 0) -> Iterator[torch.device]:
    """Build modules (and tensors) inside the block on ``spec``; yields the resolved ``torch.device``.

    Every parameter and buffer registered inside the block lands on the device, even one made from a
    CPU array, and its module gets the input-moving hook, so modules built in different scopes can be
    chained in one model. Scopes nest; the innermost wins. The registration hooks are process-wide, so
    avoid building modules in other threads meanwhile.
    """
    log = log or logging.getLogger(LOGGER_NAME)
    target = _resolve(spec, soft, log, local_rank)

    def on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None:
            return None
        if module not in _hooked:
            _hook(module)
        if param.device == target:
            return None
        return nn.Parameter(param.detach().to(target), requires_grad=param.requires_grad)

    def on_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
        if buffer is None:
            return None
        if module not in _hooked:
            _hook(module)
        return None if buffer.device == target else buffer.to(target)

    handles = [register_module_parameter_registration_hook(on_parameter),
               register_module_buffer_registration_hook(on_buffer)]
    try:
        with target:  # tensor factories inside the block allocate on the device directly
            yield target
    finally:
        for handle in handles:
            handle.remove()


def model_devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices of ``model``'s parameters and buffers, in registration order."""
    found: list[torch.device] = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device not in found:
            found.append(tensor.device)
    return found


def model_output_device(model: nn.Module) -> torch.device:
    """Where a placed model's output most likely lands: the device of its last-registered parameter.

    A heuristic for sequential models (the last layer registered runs last); the exact answer is
    ``outputs.device`` after the forward pass, which is what the loss should use when it can.
    """
    last = None
    for last in model.parameters():
        pass
    if last is None:
        for last in model.buffers():
            pass
    return last.device if last is not None else torch.device("cpu")


def model_input_device(model: nn.Module) -> torch.device:
    """The device of the first-registered parameter: where putting the inputs saves one copy."""
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")
