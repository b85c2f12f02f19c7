"""Whether a factory gives its model real weights: what it writes into the model's tensors while it is built on
the meta device.

A model built on the meta device has no values, so polytrain gives it values itself (each unit from the run's
seed, :mod:`polytrain.models.deferred`). That is only right where the factory would have given it nothing but
its own initialisation. :class:`Probe` watches the build and notes every tensor of the model that receives
values the initialisation does not make:

* **loaded**: a write whose source is a tensor with data, not on the meta device (``load_state_dict`` of a
  ``torch.load``-ed file, ``copy_`` from a NumPy array, ``from_pretrained``), or a tensor of the model that is
  not on the meta device at the end (``load_state_dict(..., assign=True)``, a ``Parameter`` made of loaded
  data);
* **set after construction**: an in-place write made outside every ``nn.Module.__init__`` (the factory's own
  ``fill_``, ``normal_`` or ``apply(init)`` on the finished model).

Writes inside a module's ``__init__`` (``reset_parameters``, ``self.apply(self._init_weights)``, a class that
calls its ``init_unit``) are initialisation: ``init_unit`` makes them again from the seed. A factory the probe
finds writing is built whole, as it is, and the run says its weights come from the factory; one that only
initialises is built on the meta device and initialised from ``--seed``.

Cost: one dispatch per tensor operation of the build on the meta device (no data), and a look up the Python
stack for each in-place one.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@dataclass
class Writes:
    """The tensors of a model that a factory gave values of its own, by name (empty: none)."""

    loaded: list[str] = field(default_factory=list)  # from data it read (a file, an array)
    after: list[str] = field(default_factory=list)  # set after the model was constructed

    def __bool__(self) -> bool:
        return bool(self.loaded or self.after)

    def describe(self) -> str:
        """What the factory did, for a message: 'loads weights into a.weight, a.bias and 3 more'."""
        parts = []
        if self.loaded:
            parts.append(f"loads weights into {_names(self.loaded)}")
        if self.after:
            parts.append(f"sets {_names(self.after)} after constructing the model")
        return " and ".join(parts)


class Probe(TorchDispatchMode):
    """The dispatch mode of a build on the meta device: keeps each meta tensor written in place, with whether
    the values came from data (``loaded``) or were written outside a module's ``__init__`` (``after``)."""

    def __init__(self) -> None:
        super().__init__()
        self._written: list[tuple[torch.Tensor, bool, bool]] = []  # (target, loaded, after); kept alive

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta:
            sources = [t for t in tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor)]
            loaded = any(not t.is_meta and t.dim() > 0 for t in sources)  # (a 0-dim one: a wrapped number)
            after = not _inside_module_init()
            if loaded or after:
                self._written.append((args[0], loaded, after))
        return out

    def writes(self, model: nn.Module) -> Writes:
        """The tensors of ``model`` the build gave values of its own."""
        storages: dict[int, tuple[bool, bool]] = {}
        for target, loaded, after in self._written:
            key = target.untyped_storage()._cdata
            was = storages.get(key, (False, False))
            storages[key] = (was[0] or loaded, was[1] or after)
        found = Writes()
        for name, tensor in _named_tensors(model):
            if not tensor.is_meta:
                found.loaded.append(name)
                continue
            loaded, after = storages.get(tensor.untyped_storage()._cdata, (False, False))
            if loaded:
                found.loaded.append(name)
            elif after:
                found.after.append(name)
        return found


def build_on_meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, Writes]:
    """``build()`` on the meta device, and what it wrote of its own into the model's tensors. Raises what the
    factory raises there (one that computes with its tensors' values cannot be built so)."""
    probe = Probe()
    with warnings.catch_warnings():
        # torch's "copying from a non-meta parameter ... is a no-op": the probe notes exactly that
        warnings.simplefilter("ignore")
        with torch.device("meta"), probe:
            model = build()
    return model, probe.writes(model) if isinstance(model, nn.Module) else Writes()


def _inside_module_init() -> bool:
    """Whether the operation being dispatched runs inside some ``nn.Module``'s ``__init__``."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return True
        frame = frame.f_back
    return False


def _named_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*model.named_parameters(), *model.named_buffers()]


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
