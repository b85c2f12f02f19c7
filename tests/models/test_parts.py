"""A model's units wherever its repeated blocks sit, and its tied tensors kept as one (models/parts.py), on
models no one here wrote: nanoGPT's shape (blocks in an nn.ModuleDict, tied head) and a transformers Llama
(blocks under the wrapper ``model``). In-process, no training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from polytrain.models.parts import retie, tie_again, tied_groups, unit_groups, units
from polytrain.models.transformer_lm import transformer_lm
from tests.helpers import zoo


def test_blocks_in_a_module_dict_are_each_a_unit_and_tied_units_one_group():
    model = zoo.nanogpt()
    names = [n for n, _ in units(model)]
    assert names == ["transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1",
                     "transformer.ln_f", "lm_head"]
    assert [n for n, _ in units(model, nested=False)] == ["transformer", "lm_head"]
    groups = [[n for n, _ in g] for g in unit_groups(units(model))]  # the tied head goes with the embedding
    assert groups == [["transformer.wte", "lm_head"], ["transformer.wpe"], ["transformer.h.0"], ["transformer.h.1"],
                      ["transformer.ln_f"]]
    assert tied_groups(model) == [["transformer.wte.weight", "lm_head.weight"]]


def test_a_wrapper_without_tensors_of_its_own_is_looked_into_and_other_models_keep_their_units():
    pytest.importorskip("transformers")
    llama = zoo.llama()
    assert [n for n, _ in units(llama)] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                                            "model.rotary_emb", "lm_head"]
    lm = transformer_lm(num_classes=16, seq_len=8, layers=2, dim=16, heads=2)
    assert [n for n, _ in units(lm)] == ["embed", "blocks.0", "blocks.1", "head"]
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert [n for n, _ in units(seq)] == ["0", "1"]

    class Holder(nn.Module):  # a wrapper with a tensor of its own stays one unit (its tensor belongs to it)
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    outer = nn.Sequential(Holder(), nn.Linear(2, 2))
    assert [n for n, _ in units(outer)] == ["0", "1"]


def test_a_tie_is_kept_through_a_change_that_replaces_parameters_and_in_a_gathered_state():
    model = zoo.nanogpt()
    ties = tied_groups(model)
    for module in (model.transformer.wte, model.lm_head):  # as tensor parallel's split does, module by module
        module.weight = nn.Parameter(module.weight.detach().clone())
    assert model.transformer.wte.weight is not model.lm_head.weight
    tie_again(model, ties)
    assert model.transformer.wte.weight is model.lm_head.weight
    state = {k: v.clone() for k, v in model.state_dict().items()}  # gathered name by name: two tensors
    assert retie(state, model)["lm_head.weight"] is state["transformer.wte.weight"]
