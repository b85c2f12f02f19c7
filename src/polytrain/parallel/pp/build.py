"""A pipeline rank's stages made from a model built on the meta device (:mod:`polytrain.models.deferred`): a
rank gives memory only to the units of its own stages, one unit at a time, with the values ``single`` starts
from. Any other unit is made only for a moment (rank 0 timing the units for ``--split-at auto``, or checking
that the forward is its units in order) and goes back to the meta device right after.

The optimizer is built over the model's parameters before any of them is made, so that its parameter indices
are ``single``'s. Making a rank's own units therefore keeps each ``Parameter`` object and swaps real contents
into it (``torch.utils.swap_tensors``); so does emptying the other stages' parameters once the split is
known (they stay in the model, holding 0 bytes). A unit made for a moment gets new tensors instead, and its
original (meta) ones are put back afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from polytrain.models.deferred import held_bytes, materialize
from polytrain.models.parts import units


@contextlib.contextmanager
def _swapping(enabled: bool) -> Iterator[None]:
    """``Module._apply`` (``to_empty``) swapping new contents into each Parameter object (kept), or not."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(enabled)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _is_meta(unit: nn.Module) -> bool:
    return any(t.is_meta for t in [*unit.parameters(), *unit.buffers()])


class UnitMaker:
    """Makes a deferred model's units on ``device``: for good (:meth:`make`), for a moment (:meth:`resident`),
    or empty (:meth:`release`), and records the most parameter and buffer bytes held meanwhile as the model's
    ``materialized_peak_bytes`` (what it cost to build this rank's part)."""

    def __init__(self, model: nn.Module, device: torch.device | str):
        self.model, self.device, self.peak = model, device, 0
        self._units = dict(units(model))

    def make(self, names: set[str]) -> None:
        """Materialise the units ``names`` for good, one at a time, each Parameter object kept."""
        with _swapping(True):
            materialize(self.model, self.device, keep=lambda name: name in names)
        self._note(self.model.materialized_peak_bytes)

    @contextlib.contextmanager
    def resident(self, name: str) -> Iterator[nn.Module]:
        """Unit ``name`` with its initial values for the time of the block, then on the meta device again (a
        unit that is already made is left as it is)."""
        unit = self._units[name]
        if not _is_meta(unit):
            yield unit
            return
        kept = [(module, dict(module._parameters), dict(module._buffers)) for module in unit.modules()]
        try:
            with _swapping(False):  # new tensors: the meta Parameter objects (the optimizer's) stay aside
                materialize(self.model, self.device, keep=lambda n: n == name)
            self._note(held_bytes(self.model))
            yield unit
        finally:
            for module, params, buffers in kept:
                module._parameters.update(params)
                module._buffers.update(buffers)

    def release(self, keep: set[str]) -> None:
        """Empty every unit not in ``keep``: its tensors hold 0 bytes on ``device`` (Parameter objects kept)."""
        for name, unit in self._units.items():
            if name not in keep:
                release_unit(unit, self.device)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict on the CPU as ``single`` starts, made one unit at a time."""
        state = self.model.state_dict()
        for name in self._units:
            with self.resident(name) as unit:
                for key, value in unit.state_dict().items():
                    state[f"{name}.{key}"] = value.detach().to("cpu", copy=True)
        return state

    def _note(self, held: int) -> None:
        self.peak = max(self.peak, held)
        self.model.materialized_peak_bytes = self.peak


def release_unit(unit: nn.Module, device: torch.device | str) -> None:
    """``unit``'s parameters and buffers emptied in place (0 elements on ``device``, dtype kept): a meta
    Parameter gets the empty contents swapped in, a real one its ``.data`` replaced, so the Parameter objects
    (the optimizer's) stay the model's."""
    for module in unit.modules():
        for param in module._parameters.values():
            if param is None:
                continue
            empty = torch.empty(0, dtype=param.dtype, device=device)
            if param.is_meta:
                torch.utils.swap_tensors(param, nn.Parameter(empty, requires_grad=param.requires_grad))
            else:
                param.data = empty
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = torch.empty(0, dtype=buffer.dtype, device=device)
