"""A model from any factory built with only some of its tensors, each with exactly the values the factory
gives it when built whole from torch's generator as it stands (``single``'s), the others on the meta device.

The factory is called twice under a dispatch mode (:class:`_Build`), never whole:

1. **Map**: every tensor it creates goes to the meta device; each random fill of a meta tensor still draws
   the same numbers from torch's CPU generator into a scratch tensor of its size (freed at once), so the
   generator ends where a whole build leaves it. Each op call is numbered; a parameter or buffer is known by
   the number of the call that made its storage.
2. **Part** (:func:`build_part`): the generator is set back to where the map began and the factory runs again;
   the calls that made the tensors not kept produce meta tensors instead (random fills of them draw into
   scratch, as in the map), every other call runs as in a whole build. The kept tensors thus get the same
   values, drawn in the same order from the same generator state. The factory's control flow must not depend
   on its tensors' values, which building on the meta device assumes anyway.

A kept tensor computed from one that is not kept cannot have its value; :class:`Unreplayable` says so, and
the caller builds the model whole instead.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.multiprocessing.reductions import StorageWeakRef

aten = torch.ops.aten
_META = torch.device("meta")
_REPLAY_ATTR = "_polytrain_replay"


class Unreplayable(RuntimeError):
    """The factory computes a kept tensor from one that is not kept (or the map does not match the build)."""


def _random(func: Any) -> bool:
    return getattr(func, "_schema", None) is not None and func._schema.is_mutable and any(
        name in func.__name__ for name in ("normal_", "uniform_", "bernoulli_", "random_", "exponential_",
                                           "geometric_", "log_normal_", "cauchy_"))


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_meta and t.dim() > 0


def _is_meta(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_meta


def _to_meta(t: Any) -> Any:
    return t.to(_META) if isinstance(t, torch.Tensor) and not t.is_meta else t


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Build(TorchDispatchMode):
    """The dispatch mode of both passes: numbers op calls; ``meta_calls`` (None: all) produce meta tensors."""

    def __init__(self, meta_calls: set[int] | None):
        super().__init__()
        self.meta_calls, self.calls, self.made = meta_calls, 0, {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        call, self.calls = self.calls, self.calls + 1
        to_meta = self.meta_calls is None or call in self.meta_calls
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if _random(func) and args and _is_meta(args[0]):
            target = args[0]  # draw what a whole build would draw here, into a scratch tensor
            scratch = torch.empty_strided(target.shape, target.stride(), dtype=target.dtype)
            func(scratch, *args[1:], **kwargs)
            return target
        if not tensors and any(a.name == "device" for a in func._schema.arguments):  # a factory: zeros, arange, ...
            if to_meta:
                kwargs = {**kwargs, "device": _META}
            out = func(*args, **kwargs)
        elif any(_is_meta(t) for t in tensors) and any(_real(t) for t in tensors):
            if func._schema.is_mutable and args and _real(args[0]):
                raise Unreplayable(f"{func} writes a kept tensor from one that is not kept")
            out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        elif to_meta and self.meta_calls is not None and not func._schema.is_mutable:
            out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        else:
            out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                key = _storage_key(t)
                known = self.made.get(key)
                if known is None or known[1].expired():  # a storage freed since may have the same address
                    self.made[key] = (call, StorageWeakRef(t.untyped_storage()))
        return out


def _named(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}


def build_map(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, int], Any]:
    """The map pass: the model on the meta device, each tensor name's call number, and the generator state
    it started from (the generator advanced as a whole build advances it)."""
    state = torch.get_rng_state()
    mode = _Build(None)
    with mode:
        model = build()
    calls = {}
    for name, tensor in _named(model).items():
        if not tensor.is_meta:
            raise Unreplayable(f"{name} was not made through torch's dispatcher")
        calls[name] = mode.made.get(_storage_key(tensor), (-1, None))[0]
    if any(call < 0 for call in calls.values()):
        raise Unreplayable("a tensor of the model was not made by a call of the build")
    return model, calls, state


def build_part(build: Callable[[], nn.Module], calls: dict[str, int], state: Any,
               keep: Callable[[str], bool]) -> nn.Module:
    """The part pass: the model with the tensors ``keep`` accepts on the CPU holding a whole build's values,
    the others on the meta device. The caller's generator state is left as it was."""
    kept = {call for name, call in calls.items() if keep(name)}  # a tied tensor: kept if one of its names is
    dropped = set(calls.values()) - kept
    with torch.random.fork_rng(devices=[]):
        torch.set_rng_state(state)
        with _Build(dropped):
            model = build()
    for name, tensor in _named(model).items():
        if (calls[name] in kept) == tensor.is_meta:
            raise Unreplayable(f"{name} is {'on the meta device' if tensor.is_meta else 'made'} in the part build")
    return model


def mark(model: nn.Module, build: Callable[[], nn.Module], calls: dict[str, int], state: Any) -> nn.Module:
    """Note on a map-pass model how to build any part of it (:func:`recipe`)."""
    object.__setattr__(model, _REPLAY_ATTR, (build, calls, state))
    return model


def recipe(model: nn.Module) -> tuple[Callable[[], nn.Module], dict[str, int], Any] | None:
    return getattr(model, _REPLAY_ATTR, None)


def fill(model: nn.Module, part: nn.Module, names: set[str] | None = None) -> None:
    """Swap ``part``'s real tensors (``names``, or all of its real ones) into ``model``'s, by name, keeping
    ``model``'s Parameter objects (the optimizer's) and dtypes."""
    own, theirs = _named(model), _named(part)
    done: set[int] = set()
    for name, value in theirs.items():
        if value.is_meta or (names is not None and name not in names) or id(own[name]) in done:
            continue
        target = own[name]
        done.add(id(target))
        new = value.detach().to(target.dtype)
        if isinstance(target, nn.Parameter):
            torch.utils.swap_tensors(target, nn.Parameter(new, requires_grad=target.requires_grad))
        else:
            parent, _, leaf = name.rpartition(".")
            owner = model.get_submodule(parent)
            for key, buffer in list(owner._buffers.items()):
                if buffer is target:
                    owner._buffers[key] = new


def build_parts(build: Callable[[], nn.Module]) -> nn.Module | None:
    """The model on the meta device with its :func:`recipe` (the map pass), for a strategy that makes only its
    part; None where that cannot be (the generator then as it was: build it whole). A chain of units by
    construction (``nn.Sequential``, ``init_unit``) is left to :mod:`polytrain.models.deferred`."""
    state = torch.get_rng_state()
    try:
        model, calls, start = build_map(build)
    except Exception:  # noqa: BLE001 - Unreplayable, or a factory that computes with its tensors' values
        torch.set_rng_state(state)
        return None
    if isinstance(model, nn.Sequential) or callable(getattr(model, "init_unit", None)):
        torch.set_rng_state(state)
        return None
    return mark(model, build, calls, start)
