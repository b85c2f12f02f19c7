"""Memory planned (polytrain/parallel/memory_plan.py): each rank's parameters, gradients, optimizer state and
activations from a model built on the meta device, per strategy, as plain data; and against measured runs: the
state bytes exactly, the activations within 5 %."""

import ast
import dataclasses
import importlib
import inspect
import json

import pytest
import torch
from torch import nn

import polytrain
from polytrain.config import make_config
from polytrain.parallel.memory_plan import estimate_memory, probe_optimizer
from polytrain.train.optim import OptimConfig, build_optimizer
from polytrain.train.run import layout_of
from tests.helpers.cli_batch import run_here

LM = dict(model="transformer_lm:layers=2,dim=64,heads=4", data="text:seq_len=32", optimizer="adam", batch_size=8)


def _estimate(**settings):
    config = make_config(**settings)
    return estimate_memory(config, layout_of(config))


def _param_bytes(**settings):
    config = make_config(**settings)
    model = polytrain.models.build_model(config.model.model, config.model.model_args, input_shape=(32,),
                                         num_classes=256)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("settings, per_element, per_tensor", [
    (dict(optimizer="sgd"), 4, 0),  # momentum 0.9: one buffer
    (dict(optimizer="sgd", momentum=0.0), 0, 0),
    (dict(optimizer="adam"), 8, 4),  # exp_avg, exp_avg_sq; a 4-byte step per tensor
    (dict(optimizer="rmsprop", momentum=0.0), 4, 4),
])
def test_the_optimizers_state_comes_from_the_optimizer(settings, per_element, per_tensor):
    cfg = OptimConfig(**settings)
    state = probe_optimizer(lambda params: build_optimizer(params, cfg, 0.1))
    assert (state.per_element, state.per_tensor) == (per_element, per_tensor)
    assert state.bytes(10) == 10 * per_element + per_tensor


def test_adagrad_holds_its_state_from_the_start():
    state = probe_optimizer(lambda params: build_optimizer(params, OptimConfig(optimizer="adagrad"), 0.1))
    assert (state.built_per_element, state.built_per_tensor) == (state.per_element, state.per_tensor) == (4, 4)


def test_each_strategy_holds_what_its_code_keeps():
    whole = _param_bytes(**LM)
    sync = _estimate(strategy="sync", workers=2, **LM)
    assert len(sync.ranks) == 2 and sync.ranks[0] == dataclasses.replace(sync.ranks[1], rank=0)
    rank = sync.ranks[0]
    assert rank.parameters == rank.gradients == whole  # transformer_lm has no buffers
    assert rank.optimizer == 2 * whole + 4 * len(list(_model().parameters()))
    assert sync.micro_batch == 4 and rank.activations > 0

    fsdp = _estimate(strategy="fsdp", workers=4, **LM)
    assert all(whole / 4 <= r.parameters < whole / 4 + 4096 for r in fsdp.ranks)  # dim-0 shards, padded
    assert sum(r.optimizer for r in fsdp.ranks) == rank.optimizer + 3 * 4 * len(list(_model().parameters()))
    assert fsdp.ranks[0].extra > 0 and "largest unit" in fsdp.ranks[0].extra_what

    pipeline = _estimate(strategy="pipeline", stages=2, split_at="blocks.1", **LM)
    assert sum(r.parameters for r in pipeline.ranks) == whole
    assert pipeline.ranks[0].holds == "stage 0 (embed .. blocks.0)" and pipeline.micro_batch == 2
    # 1f1b: stage 0 holds 2 micro-batches in flight, stage 1 one
    assert pipeline.ranks[0].activations > pipeline.ranks[1].activations

    diloco = _estimate(strategy="diloco", workers=2, **dict(LM, optimizer="sgd"))
    assert diloco.ranks[0].optimizer == 3 * whole  # inner momentum, the anchor, the outer momentum

    ps = _estimate(strategy="async", workers=2, servers=2, **LM)
    servers = [r for r in ps.ranks if r.role == "server"]
    assert [r.role for r in ps.ranks] == ["trainer", "trainer", "server", "server"]
    assert sum(r.gradients for r in servers) == whole and servers[0].activations is None
    assert ps.ranks[0].optimizer == 0 and ps.ranks[0].extra == whole  # never stepped; pull buffers

    for estimate in (sync, fsdp, pipeline, diloco, ps):
        as_json = json.loads(json.dumps(estimate.as_dict()))
        assert [r["total"] for r in as_json["ranks"]] == [r.total for r in estimate.ranks]
        assert len(estimate.describe().splitlines()) >= len(estimate.ranks) + 2


def _model():
    return polytrain.models.build_model(LM["model"], {}, input_shape=(32,), num_classes=256)


def test_precision_and_activation_checkpointing_change_the_estimate():
    plain = _estimate(strategy="single", **LM).ranks[0]
    true_bf16 = _estimate(strategy="single", precision="bf16-true", **LM).ranks[0]
    assert true_bf16.parameters * 2 == plain.parameters and true_bf16.activations < plain.activations
    mixed = _estimate(strategy="single", precision="bf16-mixed", **LM).ranks[0]
    assert mixed.state == plain.state and mixed.activations < plain.activations
    checkpointed = _estimate(strategy="single", activation_checkpointing="full", **LM)
    assert checkpointed.ranks[0].activations < plain.activations / 5
    assert any("--activation-checkpointing" in note for note in checkpointed.notes)


@pytest.mark.parametrize("strategy, extra", [
    ("sync", dict(workers=2)),
    ("pipeline", dict(pp=2, split_at="blocks.1")),
    ("hybrid", dict(workers=4, pp=2, dp_shard=2, microbatches=2, split_at="blocks.1")),
    ("pipeline", dict(pp=2, tp=2, split_at="blocks.1")),
    ("diloco", dict(workers=2, optimizer="sgd", sync_every=2)),  # (its anchor and outer momentum: local_state)
], ids=["sync", "pipeline", "hybrid-dp-shard", "pipeline-tp", "diloco"])
def test_the_plan_equals_what_a_run_measures(strategy, extra):
    settings = dict(strategy=strategy, **{**LM, **extra})
    planned = _estimate(**settings)
    summary = polytrain.fit(**settings, steps=4, progress="off", eval_every=0)
    measured = summary["rank_memory_bytes"]
    assert len(measured) == len(planned.ranks) == extra.get("workers", extra.get("pp", 1) * extra.get("tp", 1))
    for plan, run in zip(planned.ranks, measured):
        assert (plan.parameters, plan.gradients, plan.optimizer) == \
            (run["parameters"], run["gradients"], run["optimizer"])
        if "tp" not in extra:  # (with tp the plan counts the whole model's activations: an upper bound)
            assert 1.0 <= run["activations"] / plan.activations <= 1.05, (run["activations"], plan.activations)


def test_each_rank_of_a_mesh_with_tp_is_estimated_at_its_coordinates():
    pipeline = _estimate(strategy="pipeline", pp=2, tp=2, split_at="blocks.1", **LM)
    assert [r.holds for r in pipeline.ranks] == ["stage 0 (embed .. blocks.0), 1/2 of its split layers"] * 2 + \
        ["stage 1 (blocks.1 .. head), 1/2 of its split layers"] * 2  # [pp 0, tp 0], [pp 0, tp 1], [pp 1, ...]
    whole = _estimate(strategy="pipeline", pp=2, split_at="blocks.1", **LM)
    assert pipeline.ranks[0].parameters < whole.ranks[0].parameters  # the split layers halved
    hybrid = _estimate(strategy="hybrid", workers=8, dp_replicate=2, pp=2, tp=2, microbatches=2,
                       split_at="blocks.1", **LM)
    assert [r.holds.rpartition(", ")[2] for r in hybrid.ranks] == ["replica 0"] * 4 + ["replica 1"] * 4
    assert [r.state for r in hybrid.ranks] == [r.state for r in pipeline.ranks] * 2  # each replica the pipeline
    hsdp = _estimate(strategy="fsdp", workers=8, dp_replicate=2, tp=2, **LM)
    fsdp_tp = _estimate(strategy="fsdp", workers=4, tp=2, **LM)
    assert [r.state for r in hsdp.ranks] == [r.state for r in fsdp_tp.ranks] * 2
    assert fsdp_tp.ranks[0].holds == "1/2 of the whole model, 1/2 of its split layers"


def needs_real_values(input_shape, num_classes):
    """A factory that reads a value while it builds: it cannot build on the meta device."""
    weight = torch.randn(3)
    if float(weight.sum()) > 1e9:
        raise AssertionError("unreachable")
    return nn.Linear(input_shape[0], num_classes)


class _ReadsItsInput(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        self.layer = nn.Linear(width, classes)

    def forward(self, x):
        if x.abs().max().item() > 1e9:  # data-dependent: a forward without values cannot take it
            raise AssertionError("unreachable")
        return self.layer(x)


def reads_its_input(input_shape, num_classes):
    return _ReadsItsInput(input_shape[0], num_classes)


def test_what_cannot_be_built_or_run_without_values_is_said_and_the_rest_estimated():
    skipped = _estimate(strategy="single", model="tests.parallel.test_memory_plan:needs_real_values",
                        data="synthetic:shape=8,size=64")
    assert skipped.skipped.startswith("--model tests.parallel.test_memory_plan:needs_real_values cannot be "
                                      "built on the meta device")
    assert skipped.describe().startswith("memory estimate: skipped: --model ")
    no_forward = _estimate(strategy="single", model="tests.parallel.test_memory_plan:reads_its_input",
                           data="synthetic:shape=8,size=64")
    (rank,) = no_forward.ranks
    assert rank.activations is None and rank.parameters == (8 * 10 + 10) * 4
    assert any(note.startswith("activations not estimated: a forward on cpu fake tensors failed") for note in
               no_forward.notes)
    refused = _estimate(strategy="pipeline", stages=4, model="digits_cnn", data="digits")  # train refuses it too
    assert refused.skipped.endswith("use fewer stages or a deeper model") and not refused.ranks


def test_polytrain_plan_prints_the_estimate_and_puts_it_in_its_json(capsys):
    # the command's main in this process (plan starts no process: a fresh one's imports are saved)
    args = ["plan", "--strategy", "pipeline", "--split-at", "blocks.1", "--model", LM["model"], "--data", LM["data"],
            "--optimizer", "adam", "--batch-size", "8", "--memory-limit", "1MiB"]
    text = run_here(capsys, *args)
    assert text.returncode == 0, text.stderr
    table = text.stdout.split("memory estimate per rank (")[1].splitlines()
    assert table[1].split() == ["rank", "holds", "parameters", "gradients", "optimizer", "activations", "other",
                                "data", "total"]
    assert table[2].startswith("  0     stage 0 (embed .. blocks.0)")
    assert "--memory-limit 1.0 MiB per worker: rank(s) 0, 1 estimated over it" in text.stdout
    plan = json.loads(run_here(capsys, *args, "--json").stdout)
    assert plan["layout"]["processes"] == 2 and plan["memory"]["limit"] == 2**20
    assert [r["holds"] for r in plan["memory"]["ranks"]] == ["stage 0 (embed .. blocks.0)",
                                                             "stage 1 (blocks.1 .. head)"]


def test_each_part_of_the_plan_estimates_its_own_bytes_and_none_asks_for_a_strategys_name():
    """The memory plan is per axis (pp, dp_shard) and per strategy (its declared copies; async's servers): no part
    compares anything with a strategy's name, nor keys a table by one."""
    names = set(polytrain.available_strategies())
    parts = ["polytrain.parallel.memory_plan", "polytrain.parallel.memory_count", "polytrain.parallel.memory_saved",
             "polytrain.parallel.fsdp_memory", "polytrain.parallel.pp.memory", "polytrain.strategies.memory",
             "polytrain.strategies.ps.memory"]
    found = []
    for part in parts:
        for node in ast.walk(ast.parse(inspect.getsource(importlib.import_module(part)))):
            operands = [node.left, *node.comparators] if isinstance(node, ast.Compare) else \
                list(node.keys) if isinstance(node, ast.Dict) else []
            found += [f"{part}:{node.lineno} {o.value!r}" for o in operands
                      if isinstance(o, ast.Constant) and o.value in names]
            if isinstance(node, ast.Compare) and any(isinstance(o, (ast.Tuple, ast.List, ast.Set)) for o in operands):
                found += [f"{part}:{node.lineno} {e.value!r}" for o in operands if isinstance(o, (ast.Tuple, ast.List,
                          ast.Set)) for e in o.elts if isinstance(e, ast.Constant) and e.value in names]
    assert not found, f"the memory plan switches on strategy names: {found}"

