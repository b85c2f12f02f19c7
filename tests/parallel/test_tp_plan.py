"""Tensor-parallel plans as data, without processes: transformer_lm's own plan, plans from TOML files, what
each refuses before anything starts, and polytrain plan's printout (the command lines that refuse --tp are in
tests/cli/test_main.py's batch)."""

from __future__ import annotations

import pytest
from torch import nn

from polytrain.errors import ConfigError
from polytrain.models.registry import build_model
from polytrain.parallel.tp.plan import Rule, TensorPlan, plan_for


def _lm(**args):
    return build_model("transformer_lm", {"layers": 2, "dim": 32, "heads": 4, **args}, input_shape=(16,),
                       num_classes=256)


def test_transformer_lm_plan_splits_heads_and_mlp_of_every_block():
    model = _lm()
    plan = plan_for(model, "auto")
    found = [(name, rule.style, rule.parts) for name, rule, _ in plan.check(model, 2)]
    assert found == [(f"blocks.{i}.{layer}", style, parts) for i in range(2)
                     for layer, style, parts in (("attn.qkv", "colwise", 3), ("attn.proj", "rowwise", 1),
                                                 ("mlp.0", "colwise", 1), ("mlp.2", "rowwise", 1))]
    assert TensorPlan.from_mapping(plan.as_dict(), plan.source) == plan  # printable data, read back the same
    text = plan.describe(2, model)
    assert "blocks.*.attn.qkv: colwise, 3 parts, heads=heads  (2 layer(s))" in text
    assert "blocks.*.mlp.2: rowwise  (2 layer(s))" in text
    plan.check(model, 4)
    with pytest.raises(ConfigError, match="^--tp 3 does not divide the 4 attention heads of blocks.0.attn.qkv"):
        plan.check(model, 3)


def test_a_plan_from_a_toml_file(tmp_path):
    path = tmp_path / "plan.toml"
    path.write_text('[tp_plan]\n"0" = "colwise"\n"2" = { style = "rowwise" }\n')
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = plan_for(model, str(path))
    assert plan.rules == (Rule("0", "colwise"), Rule("2", "rowwise")) and plan.source == f"--tp-plan {path}"
    assert [name for name, _, _ in plan.check(model, 2)] == ["0", "2"]
    with pytest.raises(ConfigError, match="^--tp 3 does not divide the 16 output features of 0"):
        plan.check(model, 3)


@pytest.mark.parametrize("mapping, message", [
    ({}, "the tensor-parallel plan is empty"),
    ({"0": "diagonal"}, "'0' = 'diagonal' is not a plan entry"),
    ({"0": {"style": "rowwise", "parts": 3}}, "parts must be a whole number >= 1, on a colwise entry"),
    ({"9": "colwise"}, "'9' names no module of the model; module names look like 0, 2"),
    ({"1": "colwise"}, "1 is a ReLU; tensor parallel splits nn.Linear layers only"),
    ({"0": {"style": "colwise", "heads": "n_head"}}, "its parent module has no whole-number attribute 'n_head'"),
    ({"0": {"style": "colwise", "parts": 3}}, "^plan: 0 has 16 output features, not 3 equal parts"),
])
def test_what_a_plan_refuses(mapping, message):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(ConfigError, match=message):
        TensorPlan.from_mapping(mapping, "plan").check(model, 2)


def test_a_bad_plan_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("not toml [")
    with pytest.raises(ConfigError, match=f"^--tp-plan {bad}: not a TOML file"):
        plan_for(nn.Linear(2, 2), str(bad))
    with pytest.raises(ConfigError, match="^--tp-plan /nonexistent/plan.toml: cannot read it"):
        plan_for(nn.Linear(2, 2), "/nonexistent/plan.toml")


def test_polytrain_plan_prints_the_tp_plan_on_the_mesh(capsys):
    from polytrain.cli.main import main

    assert main(["plan", "--strategy", "hybrid", "--dp", "2", "--pp", "2", "--tp", "2", "--model", "transformer_lm",
                 "--data", "text"]) == 0
    shown = capsys.readouterr().out
    assert "mesh over the 8 trainer rank(s): dp_replicate 2 x pp 2 x tp 2" in shown
    assert "rank 5: trainer worker rank 5  [dp_replicate 1, pp 0, tp 1]" in shown
    assert "tensor-parallel plan (TransformerLM.tp_plan), over tp 2:" in shown
    assert "blocks.*.attn.qkv: colwise, 3 parts, heads=heads  (4 layer(s))" in shown


def test_tp_layouts_and_settings_refused_before_launch():
    from polytrain.config import make_config
    from polytrain.distributed.topology import Topology
    from polytrain.parallel.tp.strategy import TensorParallel
    from polytrain.train.run import layout_of

    layout = layout_of(make_config(strategy="tp", workers=4, tp=2))
    assert (layout.axes, layout.slices, layout.processes) == ((("dp_replicate", 2), ("tp", 2)), 2, 4)
    assert layout_of(make_config(strategy="tp", tp=4)).axes == (("dp_replicate", 1), ("tp", 4))
    assert layout_of(make_config(strategy="tp", workers=4)).axes == (("dp_replicate", 1), ("tp", 4))
    hybrid = layout_of(make_config(strategy="hybrid", dp=2, pp=2, tp=2))
    assert hybrid.axes == (("dp_replicate", 2), ("pp", 2), ("tp", 2)) and hybrid.slices == 2
    with pytest.raises(ConfigError, match=r"^--strategy tp: --workers 3 is not a multiple of --tp 2 = 2; pass "
                                          r"--workers 2"):
        layout_of(make_config(strategy="tp", workers=3, tp=2))
    with pytest.raises(ConfigError, match=r"^--strategy hybrid: --dp-replicate 2 x --pp 2 x --tp 2 = 8 processes, "
                                          r"but --workers is 4; pass --workers 8"):
        layout_of(make_config(strategy="hybrid", dp=2, pp=2, tp=2, workers=4))
    config = make_config(strategy="tp", workers=2, tp=1, model="transformer_lm", data="text")
    with pytest.raises(ConfigError, match="^--strategy tp with --tp 1 splits nothing"):
        TensorParallel.check(layout_of(config), config, None)
    with pytest.raises(ConfigError, match="^--strategy tp splits layers over --tp processes; it cannot run in one"):
        TensorParallel(Topology())


def test_a_factory_that_loads_weights_for_the_data_and_has_no_plan_is_refused_before_launch(tmp_path, capsys):
    """nanoGPT's shape, its weights loaded by its factory (a vocabulary of 256: it cannot be built for a
    placeholder shape), built on the meta device for the data's shape before launch: refused there, in one line
    with no rank (the workers' own check is the backstop: tests/weights/test_loaded_matrix.py)."""
    from polytrain.cli.main import main
    from tests.helpers import zoo

    state = zoo.write_state(tmp_path / "nanogpt.pt", seed=4)
    assert main(["train", "--strategy", "tp", "--workers", "2", "--tp", "2", "--model", "tests.helpers.zoo:nanogpt",
                 "--model-arg", f"path={state}", "--data", "text:seq_len=16", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == ["polytrain: error: --tp: --model tests.helpers.zoo:nanogpt has no tensor-parallel "
                                "plan; give one with --tp-plan FILE.toml (module name = \"colwise\" or \"rowwise\"; "
                                "see docs/tensor-parallel.md)"], err


def test_a_transformers_model_brings_its_own_plan_and_gpt2s_layers_are_refused_in_one_line():
    """transformers' plan (config.base_model_tp_plan and the class's _tp_plan) read for --tp-plan auto; GPT-2 has
    none and its Conv1D layers cannot be split; a tied embedding and output layer split alike or refused."""
    pytest.importorskip("transformers")
    import torch

    from tests.helpers import zoo

    with torch.device("meta"):
        llama, gpt2 = zoo.llama(), zoo.gpt2()
    plan = plan_for(llama, "auto")
    rules = {rule.pattern: (rule.style, rule.gather) for rule in plan.rules}
    assert rules["lm_head"] == ("colwise", True) and rules["model.embed_tokens"] == ("rowwise", False)
    assert rules["model.layers.*.self_attn.k_proj"] == ("colwise", False)
    assert rules["model.layers.*.mlp.down_proj"] == ("rowwise", False)
    assert len(plan.check(llama, 2)) == 2 + 7 * 2  # the embedding, the head, 7 layers of each block
    with pytest.raises(ConfigError, match="^--tp 4 does not divide the 2 attention heads of "
                                          "model.layers.0.self_attn.k_proj"):  # grouped-query k: 2 heads
        plan.check(llama, 4)
    with pytest.raises(ConfigError, match="^--tp: --model GPT2LMHeadModel has no tensor-parallel plan"):
        plan_for(gpt2, "auto", "GPT2LMHeadModel")
    with pytest.raises(ConfigError, match="transformer.h.0.mlp.c_fc is a Conv1D; tensor parallel splits nn.Linear"):
        TensorPlan.from_mapping({"transformer.h.*.mlp.c_fc": "colwise"}, "plan").check(gpt2, 2)
    vocab = {"transformer.wte": "rowwise", "lm_head": {"style": "colwise", "gather": True}}
    TensorPlan.from_mapping(vocab, "plan").check(gpt2, 2)  # both by rows: the tied tensor stays one
    with pytest.raises(ConfigError, match=r"^--tp 3 does not divide the 256 rows \(vocabulary\) of transformer.wte"):
        TensorPlan.from_mapping(vocab, "plan").check(gpt2, 3)
    llama._tp_plan = {**llama._tp_plan, "model.norm": "sequence_parallel"}
    with pytest.raises(ConfigError, match="^LlamaForCausalLM's transformers tp plan .config.base_model_tp_plan.: its "
                                          "styles sequence_parallel are not ones polytrain splits by"):
        plan_for(llama, "auto")
    with pytest.raises(ConfigError, match="transformer.wte.weight and lm_head.weight are one tensor .tied weights., "
                                          "which the plan splits differently"):
        TensorPlan.from_mapping({"lm_head": {"style": "colwise", "gather": True}}, "plan").check(gpt2, 2)
