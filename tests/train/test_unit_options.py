"""``--activation-checkpointing`` and ``--compile`` (per unit) on real runs: the same gradients as without,
bit for bit; far less activation memory; the model's keys, names and pickling unchanged; the same training
compiled as eager, within float rounding; bad values one line before anything starts."""

import copy
import dataclasses
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from polytrain.config import make_config
from polytrain.data.registry import build_data
from polytrain.distributed.topology import Topology
from polytrain.errors import ConfigError
from polytrain.models.registry import build_model
from polytrain.models.transformer_lm import transformer_lm
from polytrain.train.run import check
from polytrain.train.trainer import Trainer
from polytrain.train.unit_options import UnitConfig, apply_unit_options, check_model_units, is_checkpointed
from tests.helpers.cli_batch import run_here
from tests.helpers.spawn import spawn

# dropout on: checkpointing must replay the same masks in backward
MODEL = "transformer_lm:layers=2,dim=32,heads=2,dropout=0.1"  # units: embed, blocks.0, blocks.1, head
RUN = dict(model=MODEL, batch_size=8, steps=1, optimizer="sgd", lr=0.1, seed=3, progress="off", eval_every=0,
           timeout=60)


def _bundle():
    data = build_data("text", {"seq_len": 16}, seed=0)
    return dataclasses.replace(data, test=None)  # no evaluation: the step's gradients are what is compared


def _gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The gradients of the step just taken (a pipeline rank: those of its own stages)."""
    return {name: p.grad.detach().clone() for name, p in trainer.session.strategy.module.named_parameters()
            if p.grad is not None and p.grad.numel()}


def _step(topology: Topology, bundle, **settings) -> tuple[dict[str, torch.Tensor], Trainer]:
    trainer = Trainer(make_config(**{**RUN, **settings}), topology, data=bundle)
    trainer.fit()
    return _gradients(trainer), trainer


def _assert_identical(grads: dict, reference: dict) -> None:
    assert grads.keys() == reference.keys() and grads
    different = [name for name in reference if not torch.equal(grads[name], reference[name])]
    assert not different, f"gradients differ in {different}"


@pytest.mark.parametrize("setting, chosen", [
    ("full", ["embed", "blocks.0", "blocks.1", "head"]),
    ("every:2", ["blocks.0", "head"]),  # the 2nd and 4th unit in forward order
])
def test_single_gradients_are_bit_identical_with_checkpointing(setting, chosen):
    bundle = _bundle()
    reference, _ = _step(Topology(), bundle, strategy="single")
    grads, trainer = _step(Topology(), bundle, strategy="single", activation_checkpointing=setting)
    _assert_identical(grads, reference)
    model = trainer.session.strategy.module
    assert [name for name, unit in [("embed", model.embed), ("blocks.0", model.blocks[0]),
                                    ("blocks.1", model.blocks[1]), ("head", model.head)]
            if is_checkpointed(unit)] == chosen
    assert f"units: activation checkpointing ({setting}) on {len(chosen)} of 4 units: {', '.join(chosen)}" in \
        trainer.session.describe().splitlines()


def test_checkpointing_replays_bf16_autocast_bit_for_bit():
    bundle = _bundle()
    reference, _ = _step(Topology(), bundle, strategy="single", precision="bf16-mixed")
    grads, _ = _step(Topology(), bundle, strategy="single", precision="bf16-mixed", activation_checkpointing="full")
    _assert_identical(grads, reference)


def _parallel_gradients(ctx, bundle):
    """On each rank: this rank's gradients after one step of sync, pipeline (1f1b, and zero-bubble, whose
    backward is split in an input and a weight part) and fsdp, each without and with checkpointing."""
    cases = {"sync": dict(strategy="sync"),
             "pipeline-1f1b": dict(strategy="pipeline", stages=2, microbatches=4, schedule="1f1b"),
             "pipeline-zero-bubble": dict(strategy="pipeline", stages=2, microbatches=4, schedule="zero-bubble"),
             "fsdp": dict(strategy="fsdp")}
    out = {}
    for name, settings in cases.items():
        for setting in ("off", "full"):
            grads, _ = _step(ctx.topology, bundle, activation_checkpointing=setting, **settings)
            # fsdp: each rank's shard of every gradient, compared as it is
            out[name, setting] = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in grads.items()}
    return out


def test_sync_pipeline_and_fsdp_gradients_are_bit_identical_with_checkpointing():
    ranks = spawn(_parallel_gradients, 2, _bundle())
    for rank in ranks:
        for name in ("sync", "pipeline-1f1b", "pipeline-zero-bubble", "fsdp"):
            _assert_identical(rank[name, "full"], rank[name, "off"])
    # each pipeline rank holds the gradients of its own stages only: between them, all of the model's
    for name in ("pipeline-1f1b", "pipeline-zero-bubble"):
        assert set(ranks[0][name, "off"]) | set(ranks[1][name, "off"]) == set(ranks[0]["sync", "off"])


def _saved_bytes(model: nn.Module, tokens: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd keeps for backward during one forward (parameters not
    counted; with checkpointing, only each checkpointed unit's inputs), and the forward's output."""
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(tokens)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(size for ptr, size in storages.items() if ptr not in params), out


def test_checkpointing_keeps_far_less_activation_memory_for_backward():
    """8 blocks of width 64 over 256 tokens (docs/activation-checkpointing.md has the numbers): full keeps
    7 % of the activation bytes (the 9 unit inputs and the tokens), every:2 about half, and the gradients
    stay bit for bit the same."""
    tokens = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(0))
    saved, grads = {}, {}
    for setting in ("off", "full", "every:2"):
        torch.manual_seed(0)
        model = transformer_lm(input_shape=(256,), num_classes=256, layers=8, dim=64, heads=4)
        apply_unit_options(model, UnitConfig(activation_checkpointing=setting))
        torch.manual_seed(1)
        saved[setting], logits = _saved_bytes(model, tokens)
        F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
        grads[setting] = {name: p.grad for name, p in model.named_parameters()}
    unit_input = 2 * 256 * 64 * 4  # one (batch, time, dim) float32 activation
    assert saved["full"] <= 0.6 * saved["off"]  # the requirement: at least 40 % less
    assert saved["full"] == 9 * unit_input + tokens.numel() * 8  # the 8 blocks' and the head's inputs, the tokens
    assert 0.3 * saved["off"] < saved["every:2"] < 0.7 * saved["off"]
    for setting in ("full", "every:2"):
        _assert_identical(grads[setting], grads["off"])


def test_keys_names_copies_and_pickles_are_unchanged():
    torch.manual_seed(0)
    plain = transformer_lm(input_shape=(16,), num_classes=64, layers=2, dim=16, heads=2, dropout=0.1)
    model = apply_unit_options(copy.deepcopy(plain), UnitConfig(activation_checkpointing="full"))
    assert list(model.state_dict()) == list(plain.state_dict())
    assert [name for name, _ in model.named_modules()] == [name for name, _ in plain.named_modules()]
    plain.load_state_dict(model.state_dict())  # checkpoints move between the two as they are
    tokens = torch.randint(0, 64, (2, 16))
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(is_checkpointed(unit) for unit in (other.embed, *other.blocks, other.head))
        # the copy checkpoints its own forward: its gradients land on its own parameters, equal to the original's
        for m in (model, other):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(2)
            m(tokens).sum().backward()
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            assert p is not q and torch.equal(p.grad, q.grad), name


@pytest.mark.slow  # compiling 3 units with a cold inductor cache: 20-60 s on 2 shared cores (4 s warm)
def test_compiled_training_equals_eager_within_float_rounding():
    """The same 4 steps eager and compiled (checkpointed too), dropout off (inductor draws dropout masks from
    its own generator). Inductor fuses and reorders float32 operations (a fused layer norm sums in another
    order), so the two agree to float32 rounding carried through 4 updates, not bit for bit: 1e-5 relative,
    where a wrong gradient or a unit left out moves the loss by more than 1e-3."""
    bundle = _bundle()
    run = dict(RUN, model="transformer_lm:layers=1,dim=16,heads=2", strategy="single", steps=4, log_every=1)
    eager = Trainer(make_config(**run), Topology(), data=bundle)
    eager.fit()
    compiled = Trainer(make_config(**run, compile=True, activation_checkpointing="full"), Topology(), data=bundle)
    compiled.fit()
    assert "units: activation checkpointing (full) on 3 of 3 units: embed, blocks.0, head; torch.compile on each " \
           "of 3 units" in compiled.session.describe().splitlines()
    model = compiled.session.strategy.module
    assert all(unit._compiled_call_impl is not None for unit in (model.embed, model.blocks[0], model.head))
    state, reference = model.state_dict(), eager.session.strategy.module.state_dict()
    assert list(state) == list(reference)
    for key, value in reference.items():
        assert torch.linalg.vector_norm(state[key] - value) <= 1e-5 * torch.linalg.vector_norm(value) + 1e-7, key
    changed = max((torch.linalg.vector_norm(value - start) / torch.linalg.vector_norm(start)).item()
                  for value, start in zip(reference.values(), _initial(run, bundle).values()))
    assert changed > 1e-3  # the steps moved the parameters far more than the tolerance


def _initial(run: dict, bundle) -> dict[str, torch.Tensor]:
    return Trainer(make_config(**{**run, "steps": 1}), Topology(), data=bundle).session.strategy.module.state_dict()


def test_bad_values_are_one_line_before_anything_starts(capsys):
    for value, says in [("every:0", "'every:0': K must be >= 1 (every:1 is full), got 0"),
                        ("every:x", "'every:x': K must be a whole number >= 1, got 'x'"),
                        ("sometimes", "unknown value 'sometimes'; accepted: full, every:K (K >= 1: every K-th unit), "
                                      "off")]:
        with pytest.raises(ConfigError) as raised:
            make_config(activation_checkpointing=value)
        assert str(raised.value) == f"--activation-checkpointing: {says}"
    done = run_here(capsys, "train", "--activation-checkpointing", "every:0")  # refused before launch
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "polytrain: error: --activation-checkpointing: 'every:0': K must be >= 1 (every:1 " \
                                  "is full), got 0"


def test_every_k_beyond_the_units_and_a_model_without_units_are_one_line():
    config = make_config(model="transformer_lm:layers=2", data="text", activation_checkpointing="every:5")
    with pytest.raises(ConfigError, match=r"^--activation-checkpointing every:5: the model has 4 unit\(s\) \(embed, "
                                          r"blocks.0, blocks.1, head\), so no unit would be checkpointed; use every:K "
                                          r"with K <= 4, or full$"):
        check(config)  # before launch: the model built on the meta device
    mlp = build_model("mlp", None, input_shape=(8,), num_classes=2)
    check_model_units(mlp, UnitConfig(activation_checkpointing=f"every:{len(list(mlp.children()))}"))
    for settings, flag in [({"activation_checkpointing": "full"}, "--activation-checkpointing full"),
                           ({"compile": True}, "--compile")]:
        with pytest.raises(ConfigError) as raised:
            check(make_config(data="digits", device="cpu", **settings), model=nn.Linear(64, 10))
        assert str(raised.value) == (f"{flag}: the model (Linear) has no units (child modules) to apply it to; "
                                     "drop it, or give the model its layers as children")


def test_compile_without_a_cpp_compiler_is_one_line(capsys, monkeypatch):
    """The command's main in this process (refused before anything starts). Inductor reads $CXX (else g++) into
    its config when imported and keeps the compiler it found: the config is set as $CXX=/nonexistent/g++ would
    have set it, and what it found is forgotten before and after."""
    from torch._inductor import config, cpp_builder

    monkeypatch.setattr(config.cpp, "cxx", (None, "/nonexistent/g++"))
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        done = run_here(capsys, "train", "--compile", "--device", "cpu", "--steps", "1")
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == ("polytrain: error: --compile on CPU needs a C++ compiler (torch.compile builds C++ "
                                   "kernels), and none was found (g++, or the one $CXX names); install one (apt "
                                   "install g++) or drop --compile")
