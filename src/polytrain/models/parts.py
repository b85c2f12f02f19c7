"""A model's units and its tied tensors.

Units: the model's repeated blocks wherever they sit, each one unit, and the modules around them.
A ``ModuleList`` counts as its items, and a child that holds no tensor of its own but has a ``ModuleList``
somewhere below it (nanoGPT's ``transformer``, an ``nn.ModuleDict``; a Hugging Face ``LlamaForCausalLM``'s
``model``) counts as its own units, found the same way. ``transformer_lm`` gives ``embed, blocks.0 ...
blocks.N-1, head``; nanoGPT ``transformer.wte, transformer.wpe, transformer.h.0 ..., transformer.ln_f,
lm_head``; an ``nn.Sequential`` ``0, 1, ...``. A pipeline cuts between units, FSDP shards each (as torchtitan
shards each TransformerBlock), activation checkpointing and ``--compile`` wrap each, and a model built on the
meta device is materialised unit by unit (:mod:`polytrain.models.deferred`).

Tied tensors: one tensor under several names (GPT-2's and nanoGPT's ``lm_head.weight`` is the input
embedding's). Where a strategy cuts the model into groups (FSDP's shard groups), the units sharing a tensor go
into one group (:func:`unit_groups`), so the tensor stays one tensor with one gradient and one optimizer state.
"""

from __future__ import annotations

from torch import nn


def units(model: nn.Module, nested: bool = True) -> list[tuple[str, nn.Module]]:
    """The model's units in forward order, with their names in the whole model. ``nested=False``: only its
    top-level children (a ``ModuleList`` as its items), not looking inside them."""
    found: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        found += _units_of(name, child, nested)
    return found


def _units_of(name: str, module: nn.Module, nested: bool) -> list[tuple[str, nn.Module]]:
    if isinstance(module, nn.ModuleList):
        return [(f"{name}.{index}", item) for index, item in module.named_children()]
    if nested and _holds_blocks(module) and not _own_tensors(module):
        return [unit for child_name, child in module.named_children()
                for unit in _units_of(f"{name}.{child_name}", child, nested)]
    return [(name, module)]


def _holds_blocks(module: nn.Module) -> bool:
    return any(isinstance(sub, nn.ModuleList) and len(sub) for sub in module.modules())


def _own_tensors(module: nn.Module) -> bool:
    return any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])


def tied_groups(model: nn.Module) -> list[list[str]]:
    """The parameter names that share one tensor (two or more names each), in the model's order."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def unit_groups(found: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """``found`` (units) in groups: units that share a tensor (tied weights) in one group, placed where its
    first unit is; every other unit a group of its own."""
    owner: dict[int, int] = {}  # tensor id -> group index
    groups: list[list[tuple[str, nn.Module]]] = []
    for name, unit in found:
        ids = {id(t) for t in [*unit.parameters(), *unit.buffers()]}
        hits = sorted({owner[i] for i in ids if i in owner})
        if not hits:
            groups.append([(name, unit)])
            index = len(groups) - 1
        else:
            index = hits[0]
            groups[index].append((name, unit))
            for other in hits[1:]:  # a unit tying two earlier groups together: one group
                groups[index] += groups[other]
                groups[other] = []
                owner.update({i: index for i, g in owner.items() if g == other})
        owner.update({i: index for i in ids})
    return [group for group in groups if group]


def retie(state: dict, model: nn.Module) -> dict:
    """``state`` (the whole model's, by name) with each tied group's names holding one tensor, as ``single``'s
    state dict does (a strategy that gathers each name on its own makes copies)."""
    for group in tied_groups(model):
        for name in group[1:]:
            if group[0] in state and name in state:
                state[name] = state[group[0]]
    return state


def tie_again(model: nn.Module, groups: list[list[str]]) -> None:
    """After a change that gave each name its own new Parameter (tensor parallel splits module by module):
    each of ``groups`` (:func:`tied_groups` from before it) one Parameter again, its first name's."""
    for group in groups:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            parent, _, leaf = name.rpartition(".")
            model.get_submodule(parent)._parameters[leaf] = first
