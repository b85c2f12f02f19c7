"""Per-unit activation checkpointing and compilation: ``--activation-checkpointing`` and ``--compile``.

A model's units are what a pipeline splits and ``fsdp`` shards (:func:`polytrain.parallel.pp.split.units`):
its top-level children, an ``nn.ModuleList`` counted as its items (``transformer_lm``: ``embed, blocks.0 ...
blocks.N-1, head``; an ``nn.Sequential`` model: ``0, 1, ...``). Every model with children has units; a model
without any (one bare layer) has nothing to apply these to, which is an error rather than a silent no-op.

:func:`apply_unit_options` runs on each rank's freshly built model, before the strategy prepares it (moves,
wraps, splits or shards it):

* ``--activation-checkpointing full`` checkpoints every unit, ``every:K`` the K-th, 2K-th, ... unit in forward
  order (counted from 1, over all units): such a unit keeps only its inputs for backward and computes its
  forward again there (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which restores the
  random state, so dropout draws the same masks and the gradients are the same). The unit's ``forward`` is
  replaced on the instance by a picklable ``functools.partial``; no module is wrapped, so ``state_dict`` keys,
  ``named_modules`` names and checkpoints stay as they are. Under ``no_grad`` (evaluation) units run plainly.
* ``--compile`` compiles each unit with ``torch.compile`` (``nn.Module.compile``: the unit stays the same
  object with the same keys), after the checkpointing, so a checkpointed unit is compiled with its checkpoint.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from polytrain.errors import ConfigError
from polytrain.options import option, register_section
from polytrain.parallel.pp.split import units

_EVERY = re.compile(r"^every:(\S+)$")


def parse_activation_checkpointing(text: str) -> int:
    """0 for ``off``, 1 for ``full`` (every unit), K for ``every:K``; ValueError with the reason otherwise."""
    text = text.strip()
    if text == "off":
        return 0
    if text == "full":
        return 1
    match = _EVERY.match(text)
    if match is None:
        raise ValueError(f"unknown value '{text}'; accepted: full, every:K (K >= 1: every K-th unit), off")
    try:
        every = int(match.group(1))
    except ValueError:
        raise ValueError(f"'{text}': K must be a whole number >= 1, got '{match.group(1)}'") from None
    if every < 1:
        raise ValueError(f"'{text}': K must be >= 1 (every:1 is full), got {every}")
    return every


def _check_activation_checkpointing(text: str) -> None:
    parse_activation_checkpointing(text)


@register_section("units", "per-unit activation checkpointing and compilation", order=25)
@dataclass
class UnitConfig:
    activation_checkpointing: str = option(
        "off", "recompute units' activations in backward instead of keeping them: full (every unit), every:K "
               "(the K-th, 2K-th, ... unit) or off; units: the model's top-level children, a ModuleList's items "
               "(transformer_lm: embed, blocks.0 ..., head)", metavar="full|every:K|off",
        check=_check_activation_checkpointing)
    compile: bool = option(False, "compile each unit with torch.compile (the first steps are slower while it "
                                  "compiles; needs a C++ compiler on CPU)")


def chosen_units(model: nn.Module, setting: str) -> list[tuple[str, nn.Module]]:
    """The units ``--activation-checkpointing setting`` checkpoints, with their names; one ConfigError line
    when the model has no units or ``every:K`` names none of them."""
    every = parse_activation_checkpointing(setting)
    if not every:
        return []
    found = _units_or_error(model, f"--activation-checkpointing {setting}")
    if every > len(found):
        raise ConfigError(f"--activation-checkpointing {setting}: the model has {len(found)} unit(s) "
                          f"({_names(found)}), so no unit would be checkpointed; use every:K with K <= "
                          f"{len(found)}, or full")
    return [unit for index, unit in enumerate(found, start=1) if index % every == 0]


def _units_or_error(model: nn.Module, flag: str) -> list[tuple[str, nn.Module]]:
    found = units(model)
    if not found:
        raise ConfigError(f"{flag}: the model ({type(model).__name__}) has no units (child modules) to apply it "
                          "to; drop it, or give the model its layers as children")
    return found


def check_unit_options(config: Any, model: nn.Module | None = None) -> None:
    """Before launch: the checks :func:`apply_unit_options` makes on the model (``model``, or the named model
    built on the meta device: no memory; a factory that cannot be built so is checked in the workers), and a
    C++ compiler for ``--compile`` on CPU. One ConfigError line each."""
    options = config.units
    if not parse_activation_checkpointing(options.activation_checkpointing) and not options.compile:
        return
    if options.compile and _on_cpu(config.device.device):
        _check_cpp_compiler()
    if model is None and config.model.model != "auto":
        from polytrain.models.registry import meta_model

        model = meta_model(config)
    if model is not None:
        check_model_units(model, options)


def check_model_units(model: nn.Module, options: UnitConfig) -> None:
    """The model-dependent checks of :func:`apply_unit_options`, without changing ``model``."""
    chosen_units(model, options.activation_checkpointing)
    if options.compile:
        _units_or_error(model, "--compile")


def apply_unit_options(model: nn.Module, options: UnitConfig) -> nn.Module:
    """Checkpoint and compile ``model``'s units in place, as ``options`` says; returns ``model``."""
    for _, unit in chosen_units(model, options.activation_checkpointing):
        checkpoint_unit(unit)
    if options.compile:
        found = _units_or_error(model, "--compile")
        # torch.compile keeps at most recompile_limit (8) compiled versions per Python function; units share
        # functions (the blocks their class's forward, checkpointed units the checkpointing function), and each
        # needs a version per grad mode (training, evaluation) and batch shape: give every unit the budget one
        # compiled function has, or later units would silently run uncompiled
        dynamo_config = torch._dynamo.config
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 8 * len(found))
        for _, unit in found:
            unit.compile()
    return model


def _on_cpu(device: str) -> bool:
    from polytrain.devices.spec import parse_device

    kind = parse_device(device).type
    return kind == "cpu" or (kind == "auto" and not torch.cuda.is_available())


def _check_cpp_compiler() -> None:
    """torch.compile's CPU code is C++ built at run time: a missing compiler is one line here, not a
    traceback from every worker at its first step."""
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise ConfigError("--compile on CPU needs a C++ compiler (torch.compile builds C++ kernels), and none "
                          "was found (g++, or the one $CXX names); install one (apt install g++) or drop "
                          "--compile") from None


def checkpoint_unit(unit: nn.Module) -> None:
    """Make ``unit`` keep only its inputs for backward and recompute its forward there (non-reentrant
    ``torch.utils.checkpoint``, random state preserved). The module, its names and keys are unchanged; its
    hooks run once, outside the checkpoint."""
    if isinstance(unit.__dict__.get("forward"), functools.partial) and \
            unit.__dict__["forward"].func is _checkpointed_forward:
        return
    unit.forward = functools.partial(_checkpointed_forward, unit, unit.__dict__.get("forward"))


def is_checkpointed(unit: nn.Module) -> bool:
    forward = unit.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def _checkpointed_forward(unit: nn.Module, own_forward: Any, *args: Any, **kwargs: Any) -> Any:
    # a module-level function bound with functools.partial (not a closure): pickling and copy.deepcopy copy
    # the partial with the unit, so a copied unit checkpoints its own forward, never the original's
    forward = own_forward if own_forward is not None else functools.partial(type(unit).forward, unit)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def describe_unit_options(options: UnitConfig, model: nn.Module) -> list[str]:
    """The session's opening line about these options (none when both are off)."""
    parts = []
    if parse_activation_checkpointing(options.activation_checkpointing):
        found = units(model)
        chosen = [name for name, unit in found if is_checkpointed(unit)]
        parts.append(f"activation checkpointing ({options.activation_checkpointing}) on {len(chosen)} of "
                     f"{len(found)} units: {', '.join(chosen)}")
    if options.compile:
        parts.append(f"torch.compile on each of {len(units(model))} units")
    lines = [f"units: {'; '.join(parts)}"] if parts else []
    if options.compile:  # else minutes without a word: the first step compiles before it trains
        lines.append("compiling: the first step compiles each unit (a minute or more on a CPU), the next ones run "
                     "compiled")
    return lines


def _names(found: list[tuple[str, nn.Module]]) -> str:
    return ", ".join(name for name, _ in found)
