"""A model's weights are the user's: a factory that loads weights (or sets them after constructing the model)
trains from exactly those under every strategy, and the start-up line says where the weights come from; only a
model that arrives with nothing but its initialisation is initialised from ``--seed``."""

from __future__ import annotations

import pytest
import torch

import polytrain
from polytrain.models.deferred import build_for_run, describe_whole_build, probe_factory
from polytrain.models.registry import build_model
from tests.models.weights_factories import Net

FACTORY = "tests.models.weights_factories"
SHAPE = (1, 4, 4)
RUN = dict(data="synthetic:shape=1x4x4,size=64,test_size=16", batch_size=16, steps=1, lr=0.0, optimizer="sgd",
           seed=5, progress="lines", eval_every=0, timeout=120)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    torch.manual_seed(123)  # not the run's seed: values no initialisation of the run could give
    path = tmp_path_factory.mktemp("weights") / "net.pt"
    torch.save(Net(SHAPE, 10).state_dict(), path)
    return path


def _build(spec, **args):
    return lambda: build_model(spec, args, input_shape=SHAPE, num_classes=10)


def test_the_probe_tells_a_factory_that_loads_or_sets_weights_from_one_that_only_builds(weights):
    model, writes = probe_factory(_build(f"{FACTORY}:pretrained", path=str(weights)), seed=5)
    assert model is None and sorted(writes.loaded) == ["body.1.bias", "body.1.weight", "head.bias", "head.weight"]
    model, writes = probe_factory(_build(f"{FACTORY}:head_set"), seed=5)
    assert model is None and writes.after == ["head.weight"] and not writes.loaded
    model, writes = probe_factory(_build(f"{FACTORY}:plain"), seed=5)
    assert model is not None and not writes and all(p.is_meta for p in model.parameters())


def test_build_for_run_keeps_loaded_weights_and_says_where_they_come_from(weights):
    model, origin = build_for_run(_build(f"{FACTORY}:pretrained", path=str(weights)), seed=5)
    saved = torch.load(weights, weights_only=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert origin == "weights from the factory (it loads weights into body.1.weight, body.1.bias, head.weight " \
                     "and 1 more)"
    assert "its factory loads weights into body.1.weight" in describe_whole_build(model, "Net")
    assert build_for_run(_build(f"{FACTORY}:plain"), seed=5)[1] == "initialised from --seed 5"
    assert build_for_run(_build(f"{FACTORY}:head_set"), seed=5)[0].head.weight.eq(0.25).all()
    # the whole model a run of that seed starts from, for a plain loop to compare against: the file's
    whole = build_model(f"{FACTORY}:pretrained", {"path": str(weights)}, input_shape=SHAPE, num_classes=10, seed=5)
    assert torch.equal(whole.head.weight, saved["head.weight"])


@pytest.mark.parametrize("strategy", [dict(strategy="single"), dict(strategy="fsdp", workers=2)],
                         ids=["single", "fsdp-2"])
def test_a_run_starts_from_the_weights_its_factory_loads(tmp_path, weights, capfd, strategy):
    out = tmp_path / "model.pt"
    polytrain.fit(**RUN, **strategy, model=f"{FACTORY}:pretrained", model_args={"path": str(weights)},
                  save_model=str(out))
    saved, trained = torch.load(weights, weights_only=True), torch.load(out, weights_only=True)
    for key, value in saved.items():
        assert torch.equal(trained[key], value), key  # lr 0: exactly the loaded weights
    if strategy["strategy"] == "single":  # (a worker's lines go where its fork server's output went)
        assert "parameters; weights from the factory (it loads weights into body.1.weight" in capfd.readouterr().out
