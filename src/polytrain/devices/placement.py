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
from torch.nn.utils.rnn import PackedSequence

from polytrain.devices.plan import DeviceValue, PlacementPlan
from polytrain.devices.spec import LOGGER_NAME, parse_device, resolve_device
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
    resolved = _resolve_all(plan.devices(), soft, log, local_rank)
    targets = {name: resolved[value] for name, value in assigned.items()}
    _check_shared(model, targets)
    _move(model, targets)
    install_input_hooks(model)
    log.info("placement: %s", ", ".join(f"{p or '(root)'} -> {resolved[v]}" for p, v in plan.entries))
    return model


def _resolve_all(values: list[DeviceValue], soft: bool, log: logging.Logger,
                 local_rank: int) -> dict[DeviceValue, torch.device]:
    """Resolve each distinct device once, so ``cuda:1`` and ``/gpu:1`` make one soft-placement decision."""
    by_name: dict[str, torch.device] = {}
    resolved = {}
    for value in values:
        name = str(value) if isinstance(value, torch.device) else str(parse_device(value))
        if name not in by_name:
            by_name[name] = _resolve(value, soft, log, local_rank)
        resolved[value] = by_name[name]
    return resolved


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
    """Move each placed module's own parameters, gradients and buffers to its device.

    Module by module rather than ``subtree.to()``, so no tensor travels twice (``*=cuda:0,head=cpu``
    must not pass the head through GPU memory), a tensor shared by two modules is copied once, and
    tied parameters stay one object.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    slots = _tensor_slots(model)
    copies: dict[int, torch.Tensor] = {}

    def convert(tensor: torch.Tensor, target: torch.device) -> torch.Tensor:
        if id(tensor) not in copies:
            copies[id(tensor)] = tensor.to(target)
        return copies[id(tensor)]

    for name, target in targets.items():
        # nn.Module.to() without recursion: gradients move along, parameters keep their identity
        # where PyTorch can swap the data in place (cpu <-> cuda)
        modules[name]._apply(lambda t, target=target: convert(t, target), recurse=False)
    _retie(slots)


_Slot = tuple[nn.Module, str, str, torch.Tensor]  # module, "_parameters" or "_buffers", key, tensor before


def _tensor_slots(model: nn.Module) -> list[_Slot]:
    slots = []
    for module in {id(m): m for _, m in model.named_modules(remove_duplicate=False)}.values():
        for table in ("_parameters", "_buffers"):
            slots += [(module, table, key, t) for key, t in getattr(module, table).items() if t is not None]
    return slots


def _retie(slots: list[_Slot]) -> None:
    """Where a move replaced a shared tensor in one module (meta, lazy, ...), give its twins the new one."""
    groups: dict[int, list[_Slot]] = {}
    for slot in slots:
        groups.setdefault(id(slot[3]), []).append(slot)
    for group in groups.values():
        current = [getattr(module, table)[key] for module, table, key, _ in group]
        replaced = [t for t, (_, _, _, before) in zip(current, group) if t is not before]
        if len(group) > 1 and replaced:
            for module, table, key, _ in group:
                getattr(module, table)[key] = replaced[0]


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
    if isinstance(obj, PackedSequence):
        return obj.data.device != target
    if isinstance(obj, (tuple, list)):
        return any(_needs_move(item, target) for item in obj)
    if isinstance(obj, dict):
        return any(_needs_move(item, target) for item in obj.values())
    return False


def to_device(obj: Any, target: torch.device) -> Any:
    """``obj`` with every tensor in it (through tuples, named tuples, lists and dicts) moved to ``target``.

    Copies are blocking: a non-blocking copy to the CPU could be read before it lands. A PackedSequence
    moves by its own ``.to``, which keeps its ``batch_sizes`` on the CPU as RNNs require.
    """
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == target else obj.to(target)
    if isinstance(obj, PackedSequence):
        return obj.to(target)  # its own rule: batch_sizes must stay on the CPU
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
    if not _scopes:
        _scope_handles[:] = [register_module_parameter_registration_hook(_on_parameter),
                             register_module_buffer_registration_hook(_on_buffer)]
    _scopes.append(target)
    try:
        with target:  # tensor factories inside the block allocate on the device directly
            yield target
    finally:
        _scopes.pop()
        if not _scopes:
            for handle in _scope_handles:
                handle.remove()
            _scope_handles.clear()


# open device() scopes, innermost last; one pair of registration hooks serves them all, so the
# innermost scope decides (PyTorch would run one hook per scope, outermost first)
_scopes: list[torch.device] = []
_scope_handles: list[Any] = []


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
    if param is None or not _scopes:
        return None
    if module not in _hooked:
        _hook(module)
    target = _scopes[-1]
    if param.device == target:
        return None
    return nn.Parameter(param.detach().to(target), requires_grad=param.requires_grad)


def _on_buffer(module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
    if buffer is None or not _scopes:
        return None
    if module not in _hooked:
        _hook(module)
    return None if buffer.device == _scopes[-1] else buffer.to(_scopes[-1])


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
